"""The distribution as a user installs it: every package is in the wheel, and a wheel install (no source
tree, no editable finder) gives a working `dfo` with the built-in inventory and every command."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHIPPED = ("pyproject.toml", "README.md", "orchestrator", "trainer", "inventory")


def declared_packages() -> set[str]:
    return set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])


def test_every_package_directory_is_declared_in_pyproject() -> None:
    found = {
        ".".join(init.parent.relative_to(REPO).parts)
        for top in ("orchestrator", "trainer")
        for init in (REPO / top).rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    assert found - declared_packages() == set(), "add these to [tool.setuptools] packages in pyproject.toml"


@pytest.mark.slow
def test_a_wheel_install_has_every_command_and_the_builtin_inventory(tmp_path: Path) -> None:
    source = tmp_path / "src"  # a copy, so the build leaves no build/ or egg-info in the shared checkout
    source.mkdir()
    for name in SHIPPED:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(REPO / name, source / name)
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path / "whl", source], check=True, timeout=120)
    (wheel,) = (tmp_path / "whl").glob("dfo-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "orchestrator/builtin/default.yaml" in names and "orchestrator/commands/preflight.py" in names

    # A venv that sees this venv's dependencies through a plain path entry (so the editable finder of the
    # source checkout is not loaded) and has dfo only from the wheel.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=60)
    site = Path(subprocess.check_output([venv / "bin/python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip())
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([*pip, "--python", venv / "bin/python", "install", "--no-deps", "-q", wheel], check=True, timeout=120)

    home = tmp_path / "home"
    home.mkdir()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home)}
    run = lambda *args: subprocess.run([venv / "bin/dfo", *args], capture_output=True, text=True, timeout=60, env=env, cwd=home)  # noqa: E731
    where = subprocess.check_output([venv / "bin/python", "-c", "import orchestrator; print(orchestrator.__file__)"], text=True, env=env, cwd=home)
    assert where.startswith(str(site)), where
    top = run("--help")
    assert all(command in top.stdout for command in ("inventory", "preflight", "launch", "watch", "batch")), top.stdout
    preflight = run("preflight", "--host", "here", "--json")
    # no GPU here, and a workspace the first launch creates: ready for CPU runs (it exited 1 while a missing
    # workspace failed the preflight)
    assert preflight.returncode == 0 and "Traceback" not in preflight.stderr, preflight.stderr + preflight.stdout
    (report,) = json.loads(preflight.stdout)
    ssh_check = {key: report["checks"][0][key] for key in ("name", "ok", "detail", "skipped")}
    assert report["target"] == "here" and ssh_check == {"name": "ssh", "ok": True, "detail": "local (this machine, no SSH)", "skipped": False}
