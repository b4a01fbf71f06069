"""A stored decision is read through one reader (decide.read_stored, Decision.read): the typed Decision with its
Verdict and Action enums. One of an older dfo's shape or a damaged row is shown as unreadable by `dfo runs`,
`dfo metrics` and `dfo compare`, never a traceback, never a guess; the JSON this dfo writes reads back whole."""

from __future__ import annotations

import json

import pytest

from harness import cli as harness_cli
from orchestrator.decide import Decision, read_stored
from orchestrator.states import Action, Verdict
from orchestrator.store import Run, Store

DAMAGED = {
    "old": {"verdict": "steady", "tok_s": 1000},  # no `decision`: an older shape
    "unknown": {"decision": "crashed", "action": "fall"},  # a state's word where a verdict goes
    "shifts": {"decision": "steady", "steady_tok_s": 900.0, "level_shifts": [5]},  # `dfo runs NAME` raised TypeError
    "interval": {"decision": "steady", "steady_tok_s": 900.0, "interval": "x"},  # `dfo metrics`, `compare`: IndexError
    "warmup": {"decision": "steady", "evidence": "x", "warmup_end_step": "x"},  # `dfo metrics --json`: AttributeError
}


@pytest.fixture
def home(tmp_path):
    with Store(tmp_path / "state" / "dfo.db") as store:
        for name, decision in DAMAGED.items():
            store.add_run(Run(name=name, target="here", variant="v", state="exited", exit_code=0, decision=decision,
                              started_at="2026-12-03T10:00:00Z", ended_at="2026-12-03T10:05:00Z"))
        store.add_run(Run(name="good", target="here", variant="v", state="exited", exit_code=0,
                          started_at="2026-12-03T10:00:00Z", ended_at="2026-12-03T10:05:00Z",
                          decision=good_decision().to_json()))
    return {"DFO_HOME": str(tmp_path / "state")}


def good_decision() -> Decision:
    return Decision(Verdict.STEADY, "good", 400, "2026-12-03T10:04:00.000Z", None, 1000.0, 36, Action.KEEP, None,
                    [999.0, 1001.0], "steady at 1,000 tok/s", {"steady": {"figure_steps": [36, 400]}},
                    level_shifts=[{"shape": "step", "at_step": 200, "detected_step": 260, "detected_at": "x",
                                   "from_tok_s": 1200.0, "to_tok_s": 1000.0, "declared_tok_s": 1000.0,
                                   "declared_step": 300, "precision": 0.02}])


def test_the_json_this_dfo_writes_reads_back_as_the_same_typed_decision() -> None:
    decision = good_decision()
    read = Decision.read(json.loads(json.dumps(decision.to_json())))
    assert read == decision and read.decision is Verdict.STEADY and read.action is Action.KEEP
    assert read_stored(None) == (None, None)


@pytest.mark.parametrize("name", sorted(DAMAGED))
def test_a_damaged_or_old_stored_decision_is_shown_as_unreadable_by_runs_and_metrics(home, name) -> None:
    shown = harness_cli.dfo("runs", name, "--no-refresh", env=home)
    assert shown.returncode == 0, shown.output
    assert "registry: unreadable: the stored decision " in shown.stdout and "Traceback" not in shown.output
    listed = harness_cli.dfo("runs", "--no-refresh", env=home)
    assert listed.returncode == 0 and [line for line in listed.stdout.splitlines()
                                       if line.startswith(name + " ") and "(unreadable)" in line], listed.output
    metrics = harness_cli.dfo("metrics", name, env=home)
    assert metrics.returncode == 0, metrics.output
    assert f"decision: unreadable (the stored decision " in metrics.stdout
    as_json = harness_cli.dfo("metrics", name, "--json", env=home)
    assert as_json.returncode == 0, as_json.output
    row = json.loads(as_json.stdout)
    assert row["decision"] == "unreadable" and row["decision_unreadable"].startswith("the stored decision ")
    assert row["interval"] is None and row["warmup_end"] is None


def test_compare_shows_an_unreadable_decision_beside_a_good_one(home) -> None:
    compared = harness_cli.dfo("compare", "good", *sorted(DAMAGED), "--json", env=home)
    assert compared.returncode == 0, compared.output
    verdicts = {row["run"]: (row["verdict"], row["tok_s"]) for row in json.loads(compared.stdout)["runs"]}
    assert verdicts == {"good": ("steady", 1000.0), **{name: ("unreadable", None) for name in DAMAGED}}


def test_a_multinode_runs_node_with_a_damaged_decision_is_said_unreadable_and_starts_no_fallback(tmp_path) -> None:
    # multinode.py read its nodes' decisions by string: an old shape was summed up as `undecided`, and a damaged
    # crash (a signature that is no name) was taken for the run's first failure and fallen back from
    from orchestrator import multinode

    with Store(tmp_path / "dfo.db") as store:
        for node, decision in (("mn.node0", good_decision().to_json()), ("mn.node1", DAMAGED["old"]),
                               ("bad.node0", {"decision": "crash", "action": "fallback", "signature": 5}),
                               ("bad.node1", good_decision().to_json())):
            store.add_run(Run(name=node, target="here", variant="v", state="exited", exit_code=0, decision=decision))
        store.add_nodes("mn", ["mn.node0", "mn.node1"], "10.0.0.1:29500")
        store.add_nodes("bad", ["bad.node0", "bad.node1"], "10.0.0.1:29501")
        said = multinode.summary(store, "mn")
        assert said.startswith("mn: steady, unreadable on all 2 nodes; node 1 (here): unreadable: the stored decision "
                               "has no `decision`"), said
        assert "undecided" not in said
        assert "crash" not in multinode.summary(store, "bad") and "node 0 (here): unreadable" in multinode.summary(store, "bad")
        assert multinode.group_fallback(None, store, "bad") is None and store.open_intents() == []
