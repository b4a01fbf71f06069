"""`dfo inventory check`, `dfo preflight` and `dfo hostkey` as a user runs them: the console script's entry point
(tests/harness/cli.py)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from harness import STANDIN_BIN, write_inventory
from harness.cli import dfo
from harness.nvidia_smi import STATE_ENV, Gpu, NvidiaSmiState


def test_help_lists_the_commands_and_each_has_an_example() -> None:
    top = dfo("--help")
    assert top.returncode == 0 and all(name in top.stdout for name in ("inventory", "preflight", "hostkey"))
    for command in (["inventory", "check"], ["preflight"], ["hostkey", "trust"]):
        result = dfo(*command, "--help")
        assert result.returncode == 0 and "Example: dfo " in result.stdout, command


def test_broken_inventory_exits_2_with_one_line_per_problem(tmp_path: Path) -> None:
    path = write_inventory(tmp_path, {"hosts": {"pve1": {"adress": "x", "containers": {"ct200": {"ctid": "abc"}}}}})
    result = dfo("inventory", "check", "-i", str(path))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert f"dfo: error: {path}: hosts.pve1: unknown key 'adress' (did you mean 'address'?)" in lines
    assert f"dfo: error: {path}: hosts.pve1.containers.ct200.ctid: expected an integer from 100 to 999999999, got 'abc'" in lines
    assert "Traceback" not in result.stderr


def test_inventory_check_lists_targets(tmp_path: Path) -> None:
    repo_example = Path(__file__).resolve().parents[1] / "inventory" / "lab.example.yaml"
    table = dfo("inventory", "check", "-i", str(repo_example))
    assert table.returncode == 0 and "ct200" in table.stdout and "10.1.2.6" in table.stdout
    listed = json.loads(dfo("inventory", "check", "--json").stdout)
    assert listed["targets"] == [{"target": "here", "host": "local", "address": "local", "ctid": None, "gpus": []}]


def test_preflight_here_on_a_gpu_less_machine_says_it_has_no_gpu_and_what_still_works() -> None:
    result = dfo("preflight", "--host", "here", env={"PATH": "/usr/bin:/bin"})
    assert result.returncode == 0  # no GPU on a laptop is a fact, not a failure to fix (issue 14)
    assert "nvidia-smi not found" in result.stdout and "FAIL" not in result.stdout
    assert "here has no GPU (no nvidia-smi here): it is ready for CPU runs" in " ".join(result.stdout.split())
    assert "Traceback" not in result.stdout + result.stderr


def test_preflight_here_on_a_fresh_machine_passes_the_workspace_the_first_launch_creates(tmp_path: Path) -> None:
    # a new user's first `dfo preflight --host here`: no ~/dfo-workspace yet, which `dfo launch` makes (mkdir -p)
    result = dfo("preflight", "--host", "here", "--json", env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert result.returncode == 0, result.stdout + result.stderr
    [report] = json.loads(result.stdout)
    workspace = next(check for check in report["checks"] if check["name"] == "workspace")
    assert report["ok"] and workspace["ok"]
    assert workspace["detail"].startswith(f"{tmp_path}/dfo-workspace not there yet: the first launch creates it ({tmp_path} writable")
    assert not (tmp_path / "dfo-workspace").exists()  # a preflight creates nothing


def test_preflight_json_passes_with_idle_gpus(tmp_path: Path) -> None:
    state = NvidiaSmiState(tmp_path / "smi.json", gpus=[Gpu(0)])
    (tmp_path / "ws").mkdir()
    box = {"ctid": None, "workspace": str(tmp_path / "ws"), "python": sys.executable}
    inventory = write_inventory(
        tmp_path, {"defaults": {"min_free_disk_gb": 0}, "hosts": {"box": {"transport": "local", "containers": {"box1": box}}}}
    )
    env = {"PATH": f"{STANDIN_BIN}:{os.environ['PATH']}", STATE_ENV: str(state.path)}
    result = dfo("preflight", "--host", "box1", "-i", str(inventory), "--json", env=env)
    assert result.returncode == 0, result.stdout
    (report,) = json.loads(result.stdout)
    assert report["target"] == "box1" and report["ok"] is True
    assert [check["name"] for check in report["checks"]][:3] == ["ssh", "container", "nvidia_smi"]


def test_preflight_unknown_or_dangerous_target_is_a_usage_error(tmp_path: Path) -> None:
    unknown = dfo("preflight", "--host", "ct999")
    assert unknown.returncode == 2 and "known targets: here" in unknown.stderr
    dangerous = dfo("preflight", "--host", "here;touch pwned", cwd=tmp_path)
    assert dangerous.returncode == 2 and "invalid target" in dangerous.stderr
    assert not (tmp_path / "pwned").exists()


def test_hostkey_trust_refuses_a_local_host() -> None:
    result = dfo("hostkey", "trust", "local")
    assert result.returncode == 2 and "no SSH host key" in result.stderr


def test_preflight_without_a_target_is_a_usage_error_not_a_traceback() -> None:
    result = dfo("preflight")
    assert result.returncode == 2 and "Missing option '--host'" in result.stderr
    assert "Traceback" not in result.stderr


def command_paths(group, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command and command group of the app, as the words a user types."""
    paths = []
    for name, command in getattr(group, "commands", {}).items():
        paths.append((*prefix, name))
        paths += command_paths(command, (*prefix, name))
    return paths


def test_every_command_and_group_help_shows_an_example() -> None:
    import typer.main
    from typer.testing import CliRunner

    from orchestrator.cli import app

    paths = command_paths(typer.main.get_command(app))
    assert len(paths) >= 14, paths
    runner = CliRunner()
    missing = [" ".join(path) for path in paths if "Example: dfo " not in runner.invoke(app, [*path, "--help"]).output]
    assert missing == []


def test_an_ugly_inventory_is_one_line_and_exit_2_never_a_traceback(tmp_path: Path) -> None:
    binary = tmp_path / "lab.yaml"
    binary.write_bytes(b"hosts:\n\xff\xfe")
    for path in (binary, tmp_path):  # not UTF-8; a directory
        result = dfo("preflight", "--host", "ct200", "-i", str(path))
        assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
        assert result.stderr.startswith(f"dfo: error: {path}: ") and "Traceback" not in result.stderr


def test_error_text_is_printed_as_is_not_read_as_rich_markup() -> None:
    result = dfo("preflight", "--host", "[red]ct200")
    assert result.returncode == 2 and "invalid target '[red]ct200'" in result.stderr


def test_dfo_inventory_is_used_and_dash_i_wins_over_it(tmp_path: Path) -> None:
    lab = Path(__file__).resolve().parents[1] / "inventory" / "lab.example.yaml"
    from_env = json.loads(dfo("inventory", "check", "--json", env={"DFO_INVENTORY": str(lab)}).stdout)
    assert from_env["inventory"] == str(lab) and "ct200" in [row["target"] for row in from_env["targets"]]
    own = write_inventory(tmp_path, {"hosts": {"box": {"transport": "local", "containers": {"box1": {}}}}})
    from_flag = json.loads(dfo("inventory", "check", "--json", "-i", str(own), env={"DFO_INVENTORY": str(lab)}).stdout)
    assert [row["target"] for row in from_flag["targets"]] == ["box1"]
    missing = dfo("inventory", "check", env={"DFO_INVENTORY": str(tmp_path / "gone.yaml")})
    assert missing.returncode == 2 and "gone.yaml: file not found (pass an existing file with -i, or unset DFO_INVENTORY)" in missing.stderr


def test_a_container_on_a_host_without_pct_fails_its_row_plainly(tmp_path: Path) -> None:
    inventory = write_inventory(tmp_path, {"hosts": {"box": {"transport": "local", "containers": {"ct200": {"ctid": 200}}}}})
    result = dfo("preflight", "--host", "ct200", "-i", str(inventory), "--json", env={"PATH": "/usr/bin:/bin"})
    (report,) = json.loads(result.stdout)
    container = report["checks"][1]
    assert result.returncode == 1 and report["checks"][0]["ok"] and container["name"] == "container"
    assert container["detail"].startswith("ct200: host box has no `pct` command") and not container["ok"]
