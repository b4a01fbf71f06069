"""`dfo launch --json`'s line: one shape (events.LaunchAnswer) for a run of one node and a run of several, so a
script reads `run`, `nodes` and `next` the same way whichever it launched."""

from __future__ import annotations

import json
from pathlib import Path

from harness import cli

from orchestrator import runs as runs_lib
from orchestrator.commands.runs import launch_answer
from orchestrator.store import Run

KEYS = ["kind", "at", "run", "target", "pid", "log", "exit", "trainer_hash", "pushed", "rendezvous", "nodes", "next"]


def test_a_single_node_launch_line_has_the_one_shape_with_its_process_as_its_one_node(tmp_path: Path) -> None:
    inventory = tmp_path / "inv.yaml"
    inventory.write_text(json.dumps({
        "hosts": {"local": {"transport": "local", "containers": {"here": {"ctid": None, "gpus": [],
                                                                          "workspace": str(tmp_path / "ws")}}}},
        "variants": {"brief": {"command": "echo hello; exit 0"}}}))
    env = {"DFO_HOME": str(tmp_path / "state"), "HOME": str(tmp_path), "XDG_STATE_HOME": None}
    launched = cli.dfo("launch", "--host", "here", "--variant", "brief", "-i", str(inventory), "--no-preflight",
                       "--name", "one", "--json", env=env)
    assert launched.returncode == 0, launched.stderr
    line = json.loads(launched.stdout)
    assert list(line) == KEYS and (line["kind"], line["run"], line["next"]) == ("launched", "one", "dfo watch one")
    log = str(tmp_path / "ws" / "logs" / "one.log")
    assert (line["target"], line["log"], line["rendezvous"]) == ("here", log, None) and line["pid"] > 0
    assert line["nodes"] == [{"run": "one", "target": "here", "pid": line["pid"], "log": log, "exit": line["exit"]}]


def test_a_multinode_launch_line_has_the_same_keys_its_processes_being_its_nodes() -> None:
    def node(rank: int) -> runs_lib.Launched:
        return runs_lib.Launched(Run(name=f"mn.node{rank}", target=f"n{rank}", variant="ps", state="running",
                                     pid=100 + rank, log_path=f"/w/logs/mn.node{rank}.log",
                                     exit_path=f"/w/logs/mn.node{rank}.log.exit", trainer_hash="abc"), None)

    line = launch_answer("mn", [node(0), node(1)], rendezvous="10.0.0.1:29500").to_json()
    assert list(line) == KEYS and (line["run"], line["rendezvous"], line["next"]) == ("mn", "10.0.0.1:29500", "dfo watch mn")
    assert [(n["run"], n["target"], n["pid"]) for n in line["nodes"]] == [("mn.node0", "n0", 100), ("mn.node1", "n1", 101)]
    assert (line["target"], line["pid"], line["log"], line["trainer_hash"], line["pushed"]) == (None, None, None, "abc", False)
