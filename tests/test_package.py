"""The trainer package: deterministic bytes, push only when missing, corrupted transfers detected."""

from __future__ import annotations

import hashlib
import io
import os
import sys
import tarfile
import time
from pathlib import Path

import pytest

from orchestrator.errors import TransferError
from orchestrator.package import AGENT_NAME, build_package, package_files, push
from orchestrator.remote.local import LocalTarget
from orchestrator.store import Store


class RecordingTarget(LocalTarget):
    """A LocalTarget that counts round trips and bytes put, and can corrupt what it puts."""

    def __init__(self, corrupt: bool = False) -> None:
        super().__init__("ct-test")
        self.commands: list[str] = []
        self.bytes_put = 0
        self.corrupt = corrupt

    def run(self, cmd, **kw):
        self.commands.append(cmd if isinstance(cmd, str) else " ".join(cmd))
        return super().run(cmd, **kw)

    def put(self, local, remote, **kw):
        self.bytes_put += Path(local).stat().st_size
        super().put(local, remote, **kw)
        if self.corrupt:  # damage in transit, after the copy looked fine
            with open(remote, "r+b") as handle:
                handle.seek(40)
                byte = handle.read(1)
                handle.seek(40)
                handle.write(bytes([byte[0] ^ 0xFF]))


def make_tree(root: Path) -> tuple[Path, Path]:
    trainer = root / "trainer"
    (trainer / "presets").mkdir(parents=True)
    (trainer / "__init__.py").write_text("")
    (trainer / "__main__.py").write_text("print('hi')\n")
    (trainer / "presets" / "tiny.yaml").write_text("d: 1\n")
    (trainer / "__pycache__").mkdir()
    (trainer / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"junk")
    (trainer / "old.pyc").write_bytes(b"junk")
    agent = root / "agent.py"
    agent.write_text("# agent\n")
    return trainer, agent


def test_same_files_give_same_bytes_despite_mtimes_and_modes(tmp_path):
    trainer, agent = make_tree(tmp_path)
    first = build_package(package_files(trainer, agent))
    time.sleep(0.01)
    for path in trainer.rglob("*.py"):
        os.utime(path, (1_000_000, 1_000_000))
    os.chmod(trainer / "presets" / "tiny.yaml", 0o600)
    second = build_package(package_files(trainer, agent))
    assert first.data == second.data and first.sha256 == hashlib.sha256(second.data).hexdigest()
    assert first.members == (AGENT_NAME, "trainer/__init__.py", "trainer/__main__.py", "trainer/presets/tiny.yaml")
    with tarfile.open(fileobj=io.BytesIO(first.data)) as tar:
        assert {(m.mtime, m.uid, m.gid, m.uname, m.mode) for m in tar.getmembers()} == {(0, 0, 0, "", 0o644)}


def test_one_changed_file_gives_a_new_hash(tmp_path):
    trainer, agent = make_tree(tmp_path)
    before = build_package(package_files(trainer, agent))
    (trainer / "__main__.py").write_text("print('hello')\n")
    assert build_package(package_files(trainer, agent)).sha256 != before.sha256


def test_real_trainer_package_ships_sources_and_agent_without_bytecode():
    package = build_package()
    assert "trainer/__init__.py" in package.members
    assert AGENT_NAME in package.members
    assert not [m for m in package.members if "__pycache__" in m or m.endswith(".pyc")]


def test_push_transfers_once_then_costs_one_round_trip(tmp_path):
    trainer, agent = make_tree(tmp_path / "src")
    package = build_package(package_files(trainer, agent))
    workspace = str(tmp_path / "ws")
    os.mkdir(workspace)
    target, store = RecordingTarget(), Store.in_memory()

    first = push(target, workspace, package=package, store=store)
    assert first.transferred and target.bytes_put == package.size
    unpacked = Path(first.pkg_dir)
    assert (unpacked / ".complete").read_text() == package.sha256
    assert (unpacked / "trainer" / "presets" / "tiny.yaml").read_text() == "d: 1\n"
    assert (unpacked / AGENT_NAME).exists()
    assert not list((Path(workspace) / ".dfo" / "incoming").iterdir())

    target.commands.clear()
    second = push(target, workspace, package=package, store=store)
    assert not second.transferred
    assert len(target.commands) == 1 and target.bytes_put == package.size
    assert [p["bytes"] for p in store.pushes("ct-test")] == [package.size, 0]

    (trainer / "__main__.py").write_text("print('changed')\n")
    third = push(target, workspace, package=build_package(package_files(trainer, agent)))
    assert third.transferred and third.sha256 != first.sha256
    assert Path(third.pkg_dir, "trainer", "__main__.py").read_text() == "print('changed')\n"


def test_corrupted_archive_is_detected_and_nothing_is_left_unpacked(tmp_path):
    trainer, agent = make_tree(tmp_path / "src")
    package = build_package(package_files(trainer, agent))
    workspace = tmp_path / "ws"
    workspace.mkdir()
    with pytest.raises(TransferError, match="corrupted"):
        push(RecordingTarget(corrupt=True), str(workspace), package=package)
    assert sorted(p.name for p in (workspace / ".dfo").rglob("*")) == ["incoming", "pkg"]


def test_push_reports_python_and_torch_without_installing(tmp_path):
    trainer, agent = make_tree(tmp_path / "src")
    package = build_package(package_files(trainer, agent))
    workspace = str(tmp_path)
    no_python = push(LocalTarget(), workspace, package=package, python="/nonexistent/python3")
    assert no_python.python_found is False
    bare = tmp_path / "bare-python"
    bare.write_text("#!/bin/sh\nexit 1\n")  # a python whose `import` of anything fails
    bare.chmod(0o755)
    assert push(LocalTarget(), workspace, package=package, python=str(bare)).torch_found is False
    assert push(LocalTarget(), workspace, package=package, python=sys.executable).torch_found is True
