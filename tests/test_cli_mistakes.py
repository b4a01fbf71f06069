"""Mistakes a new user makes, caught before anything is launched or said plainly: an unknown trainer key, an
`--until-decided` without `--watch`, an inventory with several problems, a mistyped run name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness import write_inventory
from harness.cli import dfo, dfo_process

from orchestrator.store import Run, Store


def local_inventory(tmp_path: Path, variants: dict) -> Path:
    return write_inventory(tmp_path, {
        "defaults": {"workspace": str(tmp_path / "ws")},
        "hosts": {"local": {"transport": "local", "containers": {"here": {"ctid": None}}}},
        "variants": variants})


def test_an_unknown_trainer_key_is_refused_before_launch_with_the_closest_keys(tmp_path):
    env = {"DFO_HOME": str(tmp_path / "state"), "HOME": str(tmp_path / "home")}
    typo = dfo("launch", "--host", "here", "--variant", "nographs", "--set", "stepz=100", env=env)
    assert typo.returncode == 2, typo.output
    assert "dfo: error: --set: unknown trainer key 'stepz'; did you mean 'steps'?" in typo.stderr
    bare = dfo("launch", "--host", "here", "--variant", "eager", "--set", "lr=0.1", env=env)
    assert bare.returncode == 2 and "unknown trainer key 'lr'; did you mean 'optim.lr'?" in bare.stderr
    assert json.loads(dfo("runs", "--json", env=env).stdout) == []  # nothing launched, nothing recorded
    assert not (tmp_path / "home" / "dfo-workspace").exists()  # nor anything sent to the target


def test_an_unknown_key_in_a_variants_args_is_refused_too(tmp_path):
    inventory = local_inventory(tmp_path, {"mine": {"compile": "eager", "args": {"drafter.layer": 2}}})
    env = {"DFO_HOME": str(tmp_path / "state")}
    refused = dfo("launch", "--host", "here", "--variant", "mine", "-i", inventory, env=env)
    assert refused.returncode == 2, refused.output
    assert "variant 'mine' args: unknown trainer key 'drafter.layer'; did you mean 'drafter.layers'?" in refused.stderr
    assert json.loads(dfo("runs", "--json", env=env).stdout) == []


@pytest.mark.slow
def test_until_decided_without_watch_watches_until_the_decision(tmp_path):
    inventory = local_inventory(tmp_path, {"quick": {"command": "echo started; sleep 1; exit 3"}})
    env = {"DFO_HOME": str(tmp_path / "state")}
    done = dfo_process("launch", "--host", "here", "--variant", "quick", "--name", "q1", "--no-preflight",
                       "--until-decided", "-i", inventory, env=env)
    assert done.returncode == 1, done.output  # the run failed: not a silent exit 0 right after the launch
    [run] = json.loads(dfo("runs", "--json", "--no-refresh", env=env).stdout)
    assert run["exit_code"] == 3 and run["state"] != "running"
    help_text = " ".join(dfo("launch", "--help").stdout.split())
    assert "implies --watch" in help_text


def test_every_problem_of_an_inventory_is_reported_in_one_round(tmp_path):
    path = tmp_path / "lab.yaml"
    path.write_text("hosts:\n"
                    "  pve1:\n"
                    "    adress: 10.0.0.1\n"
                    "    containers:\n"
                    "      ct200: {ctid: 200}\n"
                    "      'bad name': {ctid: 201}\n"
                    "variants:\n"
                    "  trees: {compile: trees, topology: threads}\n"
                    "fallback: [trees, nope]\n")
    checked = dfo("inventory", "check", "-i", path)
    assert checked.returncode == 2
    lines = checked.stderr.splitlines()
    assert f"dfo: error: {path}: hosts.pve1: unknown key 'adress' (did you mean 'address'?)" in lines
    assert (f"dfo: error: {path}: variants.trees.topology: expected 'threaded' or 'procsplit', got 'threads' "
            "(did you mean 'threaded'?)") in lines
    assert any(line.startswith(f"dfo: error: {path}: hosts.pve1.containers.bad name: invalid container") for line in lines)
    assert f"dfo: error: {path}: fallback.1: unknown variant 'nope'; known variants: trees" in lines
    assert len(lines) == 4, lines


def test_a_mistyped_run_name_suggests_the_closest_runs(tmp_path):
    with Store(tmp_path / "dfo.db") as store:
        for name in ("train_nographs_20261129-1140", "train_trees_20261129-1150", "sweep.trees.ct200.r1"):
            store.add_run(Run(name=name, target="here", state="exited", exit_code=0))
    env = {"DFO_HOME": str(tmp_path)}
    prefix = dfo("logs", "train_nographs_2026", env=env)
    assert prefix.returncode == 2
    assert ("no run named 'train_nographs_2026' in the registry; did you mean 'train_nographs_20261129-1140'? "
            "(see `dfo runs`)") in prefix.stderr
    typo = dfo("stop", "train_tres_20261129-1150", env=env)
    assert typo.returncode == 2 and "did you mean 'train_trees_20261129-1150'?" in typo.stderr
    unlike = dfo("logs", "zzz", env=env)
    assert unlike.returncode == 2 and "no run named 'zzz' in the registry (see `dfo runs`)" in unlike.stderr
