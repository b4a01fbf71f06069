"""The trainer package: a deterministic tar.gz of trainer/ plus the watch agent, and pushing it into a target.

Same files -> same bytes -> same sha256: names sorted, mtime 0, uid/gid 0, no user names, modes normalised
to 0644/0755, gzip header without name or time. The archive holds `trainer/...` and `dfo_agent.py` (the
stdlib-only agent from orchestrator/agent/agent.py) and unpacks into W/.dfo/pkg/<sha256>/, whose
`.complete` file (content: the sha256) is written last. A target that already has it costs one round trip.

This module must not install anything in the target (a missing torch is reported, never fixed) and must
never leave a half-unpacked package under its final name.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import shlex
import tarfile
import tempfile
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

from .errors import DfoError, TransferError
from .remote.base import Target
from .store import Store

AGENT_NAME = "dfo_agent.py"
SKIPPED_DIRS = {"__pycache__", ".pytest_cache", "wandb", ".git"}
SKIPPED_SUFFIXES = (".pyc", ".pyo", ".swp", "~")
PROBE_TIMEOUT = 30.0
UNPACK_TIMEOUT = 120.0
PUSH_MARGIN_S = PROBE_TIMEOUT + 2 * UNPACK_TIMEOUT
"""A transfer's remote calls end within this (the directories, the copy, the check and unpack, each at its timeout)."""
SHA_MISMATCH_EXIT = 41


@dataclass(frozen=True)
class Package:
    """An archive in memory: its bytes, sha256 and the member names it holds."""

    data: bytes
    sha256: str
    members: tuple[str, ...]

    @property
    def size(self) -> int:
        return len(self.data)


@dataclass(frozen=True)
class PushResult:
    """What a push did: the package hash, whether bytes moved and how many, and what python the target has.

    python_found/torch_found are None when no python was checked."""

    sha256: str
    transferred: bool
    bytes_sent: int
    pkg_dir: str
    python_found: bool | None = None
    torch_found: bool | None = None


def trainer_dir() -> Path:
    """Where the trainer package's sources are (this checkout's trainer/, or the installed one)."""
    spec = find_spec("trainer")
    if spec is None or not spec.submodule_search_locations:
        raise DfoError("the trainer package is not installed next to dfo", hint="reinstall dfo (pip install -e .)")
    return Path(list(spec.submodule_search_locations)[0])


def agent_file() -> Path:
    return Path(__file__).resolve().parent / "agent" / "agent.py"


def package_files(trainer: Path | None = None, agent: Path | None = None) -> dict[str, Path]:
    """Archive name -> local file, for trainer/ (sources and data files) and the agent."""
    trainer = trainer or trainer_dir()
    agent = agent or agent_file()
    files = {
        f"trainer/{path.relative_to(trainer).as_posix()}": path
        for path in trainer.rglob("*")
        if path.is_file() and _shipped(path.relative_to(trainer))
    }
    if agent.is_file():
        files[AGENT_NAME] = agent
    return files


def _shipped(relative: Path) -> bool:
    if any(part in SKIPPED_DIRS or part.startswith(".") for part in relative.parts):
        return False
    return not relative.name.endswith(SKIPPED_SUFFIXES)


def build_package(files: dict[str, Path] | None = None) -> Package:
    """The deterministic archive of `files` (default: package_files())."""
    files = package_files() if files is None else files
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(files):
            _add_normalised(tar, name, files[name])
    packed = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=packed, mtime=0, compresslevel=9) as gz:
        gz.write(raw.getvalue())
    data = packed.getvalue()
    return Package(data=data, sha256=hashlib.sha256(data).hexdigest(), members=tuple(sorted(files)))


def _add_normalised(tar: tarfile.TarFile, name: str, path: Path) -> None:
    content = path.read_bytes()
    info = tarfile.TarInfo(name)
    info.size = len(content)
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mode = 0o755 if os.access(path, os.X_OK) else 0o644
    tar.addfile(info, io.BytesIO(content))


# ---------------------------------------------------------------------------------------------- push

def pkg_dir(workspace: str, sha256: str) -> str:
    return f"{workspace}/.dfo/pkg/{sha256}"


def probe_script(workspace: str, sha256: str, python: str | None = None, *, torch: bool = True) -> str:
    """Shell printing `pkg=present|absent` (is this package complete there?) and, given a python,
    `python=ok|missing` and, unless `torch` is False (the caller's own python answers it), `torch=ok|missing`
    (found without importing it)."""
    complete = shlex.quote(f"{pkg_dir(workspace, sha256)}/.complete")
    script = f'if [ "$(cat {complete} 2>/dev/null)" = {sha256} ]; then echo pkg=present; else echo pkg=absent; fi\n'
    if python:
        py = shlex.quote(python)
        has_torch = shlex.quote('import importlib.util, sys; sys.exit(0 if importlib.util.find_spec("torch") else 1)')
        script += (
            f"if command -v {py} >/dev/null 2>&1; then echo python=ok;"
            + (f" if {py} -c {has_torch} >/dev/null 2>&1; then echo torch=ok; else echo torch=missing; fi;" if torch else "")
            + " else echo python=missing; fi\n"
        )
    return script


def parse_probe(stdout: str) -> dict[str, str]:
    """`key=value` lines -> dict (later lines win)."""
    return dict(line.split("=", 1) for line in stdout.splitlines() if "=" in line)


def _found(probe: dict[str, str], key: str) -> bool | None:
    return None if key not in probe else probe[key] == "ok"


def push(
    target: Target,
    workspace: str,
    *,
    package: Package | None = None,
    store: Store | None = None,
    target_name: str | None = None,
    python: str | None = None,
    probe: dict[str, str] | None = None,
) -> PushResult:
    """Make sure `target` has `package` unpacked under W/.dfo/pkg/<sha>/; transfer only when it lacks it.

    One round trip when it is there (the probe, which also checks `python` and its torch when given).
    `probe` lets a caller that already ran probe_script in its own round trip skip ours.
    Raises TransferError when the archive arrives corrupted (nothing is left unpacked). Installs nothing.
    """
    package = package or build_package()
    if probe is None:
        probe = parse_probe(target.run(probe_script(workspace, package.sha256, python), timeout=PROBE_TIMEOUT, check=True).stdout)
    transferred = probe.get("pkg") != "present"
    if transferred:
        _transfer(target, workspace, package)
    result = PushResult(
        package.sha256,
        transferred=transferred,
        bytes_sent=package.size if transferred else 0,
        pkg_dir=pkg_dir(workspace, package.sha256),
        python_found=_found(probe, "python"),
        torch_found=_found(probe, "torch"),
    )
    if store is not None:
        store.record_push(target_name or target.name, package.sha256, result.bytes_sent)
    return result


def _transfer(target: Target, workspace: str, package: Package) -> None:
    incoming = f"{workspace}/.dfo/incoming"
    remote_archive = f"{incoming}/{package.sha256}.{os.getpid()}.tar.gz"
    target.run(["mkdir", "-p", incoming, f"{workspace}/.dfo/pkg"], timeout=PROBE_TIMEOUT, check=True)
    with tempfile.TemporaryDirectory(prefix="dfo-pkg-") as tmp:
        local = Path(tmp) / f"{package.sha256}.tar.gz"
        local.write_bytes(package.data)
        target.put(local, remote_archive, mode=0o644, timeout=UNPACK_TIMEOUT)
    result = target.run(_verify_and_unpack_script(workspace, package.sha256, remote_archive), timeout=UNPACK_TIMEOUT)
    if result.exit_code == SHA_MISMATCH_EXIT:
        raise TransferError(
            f"package archive arrived corrupted ({result.stderr.strip()}); nothing was unpacked",
            where=target.name,
            hint="run `dfo push` again",
        )
    if result.failed:
        raise TransferError(f"unpacking the package failed: {result.tail(3)}", where=target.name, hint="check disk space in the workspace")


def _verify_and_unpack_script(workspace: str, sha256: str, archive: str) -> str:
    """Check the archive's sha256, unpack into a temp dir, write .complete, then rename into place. The archive
    is hashed and unpacked from stdin, in the directory: sha256sum marks a file name holding `\\` with one
    more, and GNU tar unquotes `\\` escapes in -C and -f arguments, so a workspace with one would fail."""
    q = shlex.quote
    final = q(pkg_dir(workspace, sha256))
    return f"""
a={q(archive)}
got=$(sha256sum < "$a" | cut -d' ' -f1)
if [ "$got" != {sha256} ]; then rm -f "$a"; echo "sha256 $got, expected {sha256}" >&2; exit {SHA_MISMATCH_EXIT}; fi
d=$(mktemp -d {q(workspace + '/.dfo/pkg/.unpack.')}XXXXXX) || exit 1
if ! (cd "$d" && tar -xzf - < "$a"); then rm -rf "$d" "$a"; exit 1; fi
rm -f "$a"
printf %s {sha256} > "$d/.complete"
if [ "$(cat {final}/.complete 2>/dev/null)" = {sha256} ]; then rm -rf "$d"; exit 0; fi
rm -rf {final} && mv "$d" {final} && chmod 755 {final}
"""
