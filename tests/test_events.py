"""The watch's events: one typed class per kind, one serialisation that keeps `dfo watch --json` lines as they were."""

from __future__ import annotations

import dataclasses
import json

import pytest

from orchestrator import events as ev

AT = "2026-01-01T00:00:00.000Z"

# The JSON contract of `dfo watch --json` event lines (docs/design.md), key order included: what the dict events wrote.
CONTRACT = {
    "attached": ["at", "run", "chain", "target", "variant", "offset", "steps_stored", "owner", "claimed_by"],
    "stopping": ["at", "run", "chain", "reason"],
    "action_error": ["at", "run", "chain", "error"],
    "took_over": ["at", "run", "chain", "steps_stored"],
    "truncated": ["at", "run", "chain", "size", "why", "was"],
    "step": ["at", "run", "chain", "step", "tok_s", "loss", "phase"],
    "malformed": ["at", "run", "chain", "reason", "count"],
    "wandb": ["at", "run", "chain", "mode", "url", "dir"],
    "ended": ["at", "run", "chain", "exit_code", "state", "why"],
    "gpu": ["at", "run", "chain", "gpus"],
    "gpu_idle": ["at", "run", "chain", "gpu", "idle_since", "flagged_at", "busy_gpus", "text"],
    "unreachable": ["at", "run", "chain", "target", "duration_s", "reason"],
    "decision": ["at", "run", "chain", "decision"],
    "level_shift": ["at", "run", "chain", "at_step", "detected_step", "detected_at", "from_tok_s", "from_interval",
                    "to_tok_s", "declared", "precision", "declared_tok_s", "declared_interval", "declared_step",
                    "declared_at", "shape", "rel_per_min"],
    "acting": ["at", "run", "chain", "action", "next_variant"],
    "stopped": ["at", "run", "chain", "signal", "reason"],
    "not_signalled": ["at", "run", "chain", "why"],
    "fell_back": ["at", "run", "chain", "next_run", "variant", "nodes", "first_failed", "rest"],
    "multinode_fell_back": ["at", "run", "chain", "next_run", "nodes"],
    "left_to_batch": ["at", "run", "chain", "batch", "command"],
    "lease_held": ["at", "run", "chain", "host", "pid", "since", "lease_s"],
    "started": ["at", "run", "pid", "target", "variant", "sets", "env", "wandb"],
    "launch_failed": ["at", "run", "error"],
    "launch_resolved": ["at", "run", "pid", "how"],
    "resumed_from": ["at", "run", "from_run", "checkpoint"],
    "multinode": ["at", "run", "chain", "nodes", "first_failed", "summary"],
    "notify_failed": ["at", "run", "channel", "key", "error"],
    "disconnected": ["at", "target", "reason"],
    "gap": ["at", "target", "duration_s"],
    "gpu_error": ["at", "target", "text", "code"],
    "target_error": ["at", "target", "text"],
}
OPTIONAL_KEYS = {"claimed_by", "mode", "url", "dir", "nodes", "first_failed", "rest", "checkpoint",  # left out when unset
                 "declared_tok_s", "declared_interval", "declared_step", "declared_at", "shape", "rel_per_min"}
# `dfo launch --json`'s line (events.LaunchAnswer, never stored): a kind of its own name beside the registry's record
LAUNCH_ANSWER = ["at", "run", "target", "pid", "log", "exit", "trainer_hash", "pushed", "rendezvous", "nodes", "next"]
# `dfo resume --json`'s line (events.ResumeAnswer, never stored): `resumed`, beside the registry's `resumed_from`
RESUME_ANSWER = ["at", "run", "resumed_from", "target", "pid", "log", "nodes", "next"]
RUN_ERROR = ["at", "run", "chain", "text"]


def filled(cls: type[ev.Event]) -> ev.Event:
    """An instance with every field set (a value of the field's name, so nothing is None)."""
    return cls(**{f.name: f"{f.name}-value" for f in dataclasses.fields(cls)})


def test_every_kind_the_watcher_emits_has_one_class_and_serialises_kind_first():
    classes = ev.event_classes()
    kinds = sorted(c.kind for c in classes)
    # `error`: a run's; `launched` and `resumed`: LAUNCH_ANSWER and RESUME_ANSWER below
    assert kinds == sorted([*CONTRACT, "error", "launched", "resumed"])
    assert len(set(kinds)) == len(kinds)  # one shape per kind (`launched`, `error` and `resumed` had two each)
    for cls in classes:
        out = filled(cls).to_json()
        assert list(out)[0] == "kind" and out["kind"] == cls.kind
        answers = {ev.LaunchAnswer: LAUNCH_ANSWER, ev.ResumeAnswer: RESUME_ANSWER}
        expected = answers.get(cls) or CONTRACT.get(cls.kind) or RUN_ERROR
        assert list(out)[1:] == expected, cls.__name__
        assert json.loads(json.dumps(out)) == out


def test_optional_fields_are_left_out_when_unset_not_written_as_null():
    attached = ev.Attached(at=AT, run="r", chain="r", target="t", variant="v", offset=None, steps_stored=0, owner=True)
    assert "claimed_by" not in attached.to_json() and attached.to_json()["offset"] is None  # a plain None stays
    assert list(ev.Wandb(at=AT, run="r", chain="r", url="u").to_json()) == ["kind", "at", "run", "chain", "url"]


def test_the_registry_keeps_what_the_line_says_less_kind_time_and_run_and_not_steps_or_gpu_samples():
    stopped = ev.Stopped(at=AT, run="r", chain="c", signal="TERM", reason="crash")
    assert stopped.stored_data() == {"chain": "c", "signal": "TERM", "reason": "crash"}
    assert not ev.Step.stored and not ev.Gpu.stored and ev.DecisionMade.stored
    with pytest.raises(dataclasses.FrozenInstanceError):
        stopped.reason = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        ev.Stopped(at=AT, run="r", chain="c", signal="TERM", reason="x", extra=1)  # type: ignore[call-arg]


def test_the_live_view_scroll_back_reads_the_typed_events():
    from orchestrator.commands.watch import event_line

    # a crash is named by its signature and step, its meaning and lines left to its panel (printed once, there)
    decision = {"decision": "crash", "run": "c1", "action": "fallback", "next_run": "c1.2-nographs", "reason": "exit 1",
                "signature": "exit_nonzero", "at_step": 5}
    assert event_line(ev.DecisionMade(at=AT, run="c1", chain="c1", decision=decision)) == \
        "00:00:00 c1: crash [exit_nonzero] at step 5 (action fallback -> c1.2-nographs): the crash: in c1's panel"
    decision = {"decision": "stall", "run": "c1", "action": "fallback", "next_run": None, "reason": "no step for 30 s"}
    assert event_line(ev.DecisionMade(at=AT, run="c1", chain="c1", decision=decision)) == \
        "00:00:00 c1: stall (action fallback): no step for 30 s"
    assert event_line(ev.Gap(at=AT, target="ct_a", duration_s=4.5)) == "00:00:00 ct_a: gap duration_s=4.5"
    # a target without nvidia-smi is a CPU-only target, said plainly; a failing driver keeps its text and code
    assert event_line(ev.GpuError(at=AT, target="here", text="cannot start nvidia-smi: No such file or directory",
                                  code=127)) == "00:00:00 here: no nvidia-smi there (a CPU-only target): no GPU samples"
    assert event_line(ev.GpuError(at=AT, target="ct_a", text="NVIDIA-SMI has failed", code=9)) == \
        "00:00:00 ct_a: gpu_error text=NVIDIA-SMI has failed, code=9"
    assert event_line(ev.Ended(at=AT, run="c1", chain="c1", exit_code=1, state="crashed", why="exit status 1")) == \
        "00:00:00 c1: ended exit_code=1, state=crashed, why=exit status 1"


def test_the_channel_line_says_cpu_only_for_a_missing_nvidia_smi_and_red_text_for_a_failing_one():
    from orchestrator.view import link_text
    from orchestrator.watch import Link

    missing = link_text("here", Link(connected=True, gpu_error="cannot start nvidia-smi", gpu_error_code=127), 300)
    assert missing.plain == "here: connected, no GPU (nvidia-smi not found)"
    failing = link_text("ct_a", Link(connected=True, gpu_error="NVIDIA-SMI has failed"), 300)
    assert failing.plain == "ct_a: connected, nvidia-smi: NVIDIA-SMI has failed"
    assert any("red" in str(span.style) for span in failing.spans)


def test_the_channel_line_counts_its_gaps_with_the_noun_in_their_number():
    from orchestrator.view import link_text
    from orchestrator.watch import Link

    assert link_text("ct_a", Link(connected=True, reconnects=1, last_gap_s=4.5), 300).plain == \
        "ct_a: connected, 1 gap, last 4.5 s"  # it said "1 gap(s)"
    assert link_text("ct_a", Link(connected=True, reconnects=3, last_gap_s=2.0), 300).plain == \
        "ct_a: connected, 3 gaps, last 2.0 s"


def test_a_level_shift_reads_as_one_line_with_both_levels_before_and_after_its_new_level_is_declared():
    from orchestrator.commands.watch import event_line

    shift = {"at_step": 1861, "detected_step": 2700, "detected_at": AT, "from_tok_s": 56754.5,
             "from_interval": [55114.7, 58019.3], "to_tok_s": 40591.0, "declared_tok_s": 40296.1,
             "declared_interval": [39524.7, 41067.4], "declared_step": 2760, "declared_at": AT, "precision": 0.05}
    seen = ev.LevelShift(at=AT, run="r1", chain="r1", **ev.LevelShift.fields_of(shift, declared=False))
    assert "declared_tok_s" not in seen.to_json() and seen.to_json()["declared"] is False
    assert event_line(seen) == ("00:00:00 r1: level shift at step 1861: 56,754 -> 40,591 tok/s, verdict re-opened "
                                "at step 2700 (new level not declared yet; precision 5%)")
    held = ev.LevelShift(at=AT, run="r1", chain="r1", **ev.LevelShift.fields_of(shift, declared=True))
    assert held.to_json()["declared_interval"] == [39524.7, 41067.4]
    assert event_line(held) == ("00:00:00 r1: level shift at step 1861: 56,754 -> 40,296 tok/s, verdict re-opened "
                                "at step 2700, new level declared at step 2760 (95% 39,525..41,067)")


def test_a_decline_reads_as_one_line_saying_how_fast_the_level_fell():
    from orchestrator.commands.watch import event_line

    decline = {"shape": "decline", "at_step": 71, "detected_step": 6560, "detected_at": AT, "from_tok_s": 5002.9,
               "from_interval": [4966.8, 5038.9], "to_tok_s": 4320.4, "declared_tok_s": None, "declared_interval": None,
               "declared_step": None, "declared_at": None, "precision": 0.05, "change_rel": -0.152,
               "change_rel_95": [-0.188, -0.115], "rel_per_min": -0.054, "over_s": 169.0}
    seen = ev.LevelShift(at=AT, run="r1", chain="r1", **ev.LevelShift.fields_of(decline, declared=False))
    assert seen.to_json()["shape"] == "decline" and seen.to_json()["rel_per_min"] == -0.054
    assert event_line(seen) == ("00:00:00 r1: decline (-5.4% per minute) over the steps from 71: steady at 5,003 -> "
                                "4,320 tok/s, verdict re-opened at step 6560 (new level not declared yet; precision 5%)")


def test_a_runs_record_keeps_the_rows_shape_without_a_chain():
    resolved = ev.LaunchResolved(at=AT, run="r", pid=None, how="found ended by its exit file")
    assert resolved.stored_data() == {"pid": None, "how": "found ended by its exit file"}  # as it always was
    resumed = ev.Resumed(at=AT, run="mn.2-ps2", from_run="mn")  # a multi-node resume names no checkpoint file
    assert resumed.stored_data() == {"from_run": "mn"}


def test_the_final_line_keeps_the_decisions_own_end_beside_the_registrys_without_overwriting_either():
    # `dfo watch --json`'s final line of a run steady then crashed by its exit code, whose registry row reads
    # failed 1: a script reads both (before, the registry's `ended` overwrote the decision's `exited|crashed`)
    from orchestrator.decide import Decision

    decision = Decision.from_json({"decision": "steady", "run": "r1", "action": "keep", "reason": "steady",
                                   "steady_tok_s": 5344.0, "ended": "crashed", "exit_code": 1})
    line = ev.Final(chain="r1", decision=decision, ended={"state": "failed", "exit_code": 1}).to_json()
    assert (line["kind"], line["chain"], line["decision"]) == ("final", "r1", "steady")
    assert line["decision_ended"] == "crashed" and line["ended"] == {"state": "failed", "exit_code": 1}
    assert list(line).count("ended") == 1 and json.loads(json.dumps(line)) == line
