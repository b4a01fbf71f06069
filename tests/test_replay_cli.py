"""`dfo replay LOG`: the verdict on a recorded log, as text or the decision JSON, with an exit status."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from orchestrator.cli import app
from orchestrator.commands.common import verdicts_exit_status
from orchestrator.commands.replay import COLOURS
from orchestrator.decide import replay
from orchestrator.logfmt import format_ts

T0 = 1_795_000_000.0
TLS_CRASH = [
    "Exception in thread Thread-2 (drafter):",
    "Traceback (most recent call last):",
    '  File "/usr/local/lib/python3.11/site-packages/torch/_inductor/cudagraph_trees.py", line 312, in get_obj',
    "    assert torch._C._is_key_in_tls(attr_name)",
    "AssertionError",
]


def write_log(path, steps=300, level=120_000.0, extra=(), leak_per_step=0.0):
    rng = np.random.default_rng(0)
    lines = [f"ts={format_ts(T0)} event=start run=r"]
    for step in range(1, steps + 1):
        tok_s = level * (1 - 0.5 * np.exp(-step / 20) - leak_per_step * step) * (1 + rng.normal(0, 0.01))
        lines.append(f"ts={format_ts(T0 + 10 + step)} event=step step={step} tok_s={tok_s:.1f} loss=2.0 phase=train")
    path.write_text("\n".join(lines + list(extra)) + "\n")
    return path


def invoke(*args):
    return CliRunner().invoke(app, ["replay", *map(str, args)])


def test_steady_log_prints_the_design_json_and_exits_0(tmp_path):
    result = invoke(write_log(tmp_path / "run-a.log"), "--json")
    assert result.exit_code == 0, result.output
    decision = json.loads(result.output)
    assert (decision["decision"], decision["run"], decision["action"]) == ("steady", "run-a", "keep")
    assert abs(decision["steady_tok_s"] / 120_000 - 1) < 0.02 and decision["warmup_end_step"] > 0


def test_crash_log_names_the_signature_and_exits_1(tmp_path):
    result = invoke(write_log(tmp_path / "run-b.log", extra=TLS_CRASH))
    assert result.exit_code == 1
    assert "crash" in result.output and "cudagraph_tls" in result.output


def test_baseline_makes_a_slow_run_too_slow(tmp_path):
    result = invoke(write_log(tmp_path / "run-c.log"), "--baseline", "200000", "--json")
    assert result.exit_code == 1 and json.loads(result.output)["decision"] == "too_slow"


def test_the_exit_file_next_to_the_log_is_read(tmp_path):
    log = write_log(tmp_path / "run-d.log", steps=20)
    (tmp_path / "run-d.exit").write_text("139\n")
    decision = json.loads(invoke(log, "--json").output)
    assert (decision["decision"], decision["signature"]) == ("crash", "exit_nonzero")


def test_the_exit_file_dfo_launch_writes_is_read_too(tmp_path):
    log = write_log(tmp_path / "run-e.log", steps=20)
    (tmp_path / "run-e.log.exit").write_text("0\n")  # runs.launch: W/logs/RUN.log.exit
    decision = json.loads(invoke(log, "--json").output)
    assert (decision["decision"], decision["action"]) == ("exited", "none")
    assert decision["reason"].startswith("exited 0 before a steady state was reached")


SIGTERM_DONE = [f"ts={format_ts(T0 + 40)} event=done reason=sigterm"]


@pytest.mark.parametrize("name, steps, extra, exit_file, leak, verdict, status", [
    ("steady", 300, (), None, 0.0, "steady", 0),
    ("short", 20, (), None, 0.0, "undecided", 1),            # the log ends before a verdict: not a success
    ("leak", 700, (), None, 0.0006, "drifting", 1),          # 600 s of steps and still trending
    ("exited", 20, (), "0", 0.0, "exited", 0),
    ("stopped", 20, SIGTERM_DONE, "75", 0.0, "stopped", 0),  # the trainer's checkpointed stop
    ("crash", 300, TLS_CRASH, None, 0.0, "crash", 1),
])
def test_exit_status_is_1_exactly_for_the_verdicts_dfo_watch_fails_on(tmp_path, name, steps, extra, exit_file, leak,
                                                                        verdict, status):
    log = write_log(tmp_path / f"run-{name}.log", steps=steps, extra=extra, leak_per_step=leak)
    if exit_file is not None:
        (tmp_path / f"run-{name}.log.exit").write_text(exit_file + "\n")
    result = invoke(log, "--json")
    assert json.loads(result.output)["decision"] == verdict
    assert result.exit_code == status == verdicts_exit_status([verdict]), result.output


def test_user_format_through_regex(tmp_path):
    log = tmp_path / "mine.log"
    log.write_text("".join(f"[{format_ts(T0 + s).replace('T', ' ')[:-1]}] it {s} | 98000.0 tok/s\n" for s in range(1, 200)))
    regex = r"\[(?P<ts>[^\]]+)\] it (?P<step>\d+) \| (?P<tok_s>[\d.]+) tok/s"
    decision = json.loads(invoke(log, "--regex", regex, "--json").output)
    assert (decision["decision"], decision["steady_tok_s"]) == ("steady", 98000.0)


def test_missing_log_is_a_usage_error_naming_the_file(tmp_path):
    result = invoke(tmp_path / "nope.log")
    assert result.exit_code == 2 and "dfo: error: " in result.output and "nope.log: no such log file" in result.output


def test_inventory_variant_gives_baseline_chain_watch_keys_and_signatures(tmp_path):
    inventory = tmp_path / "lab.yaml"
    inventory.write_text(
        "hosts: {local: {transport: local, containers: {here: {ctid: null}}}}\n"
        "variants:\n"
        "  trees: {compile: trees, preset: tiny-cpu, baseline_tok_s: 200000}\n"
        "  eager: {compile: eager, preset: tiny-cpu}\n"
        "fallback: [trees, eager]\n"
        "watch: {min_steady_steps: 250}\n"
        "signatures: [{id: loader_died, pattern: 'DataLoader worker .* is killed', meaning: loader, next: eager}]\n"
    )
    slow = json.loads(invoke(write_log(tmp_path / "a.log"), "--variant", "trees", "-i", inventory, "--json").output)
    assert (slow["decision"], slow["next_variant"]) == ("too_slow", "eager") and slow["at_step"] >= 250
    died = write_log(tmp_path / "b.log", steps=50, extra=["RuntimeError: DataLoader worker (pid 7) is killed by signal"])
    decision = json.loads(invoke(died, "--variant", "trees", "-i", inventory, "--json").output)
    assert (decision["signature"], decision["action"], decision["next_variant"]) == ("loader_died", "fallback", "eager")


def test_a_level_shift_in_a_real_log_is_printed_with_both_levels_and_kept_in_the_json():
    """late_drop-0 (tests/data/probe) is steady at ~97.8k tok/s, declared 55 s in, then drops to ~83.9k at step
    615 (labels.csv): the shift is one line with both levels, and `level_shifts` in the decision JSON names both
    with intervals."""
    log = SHIFT_LOG
    result = invoke(log)
    assert result.exit_code == 0, result.output
    [line] = [line.strip() for line in result.output.splitlines() if "level shift" in line]
    assert line.startswith("level shift at step 61") and "verdict re-opened at step" in line, line
    before, after = (int(part.replace(",", "")) for part in line.split(": ", 1)[1].split(" tok/s")[0].split(" -> "))
    assert 95_000 < before < 100_000 and abs(after / 83_928 - 1) < 0.03, line
    [shift] = json.loads(invoke(log, "--json").output)["level_shifts"]
    assert shift["from_interval"][0] < shift["from_tok_s"] < shift["from_interval"][1]
    assert shift["declared_interval"][0] < shift["declared_tok_s"] < shift["declared_interval"][1] < 90_000
    assert shift["at_step"] < shift["detected_step"] <= shift["declared_step"] and shift["precision"] == 0.05


def test_a_log_that_ends_while_a_shift_is_being_confirmed_shows_the_level_before_it_and_the_suspicion(tmp_path):
    """late_drop-0 cut at step 660: ~45 s after its drop at step 615, before the shift is recorded (step 690).
    The verdict is the level before the drop with its own interval (97,374 tok/s, 95% 96,356..98,391, not a
    figure between the two levels), and both outputs say a shift is suspected since step 611 (its block)."""
    lines = SHIFT_LOG.read_text().splitlines()
    cut = next(i for i, line in enumerate(lines) if " step=660 " in line)
    log = tmp_path / "cut.log"
    log.write_text("\n".join(lines[: cut + 1]) + "\n")
    result = invoke(log)
    assert result.exit_code == 0, result.output
    assert "level shift suspected since step 611: ~" in result.output.replace("\n", "")
    decision = json.loads(invoke(log, "--json").output)
    lo, hi = decision["interval"]
    assert 95_000 < lo < decision["steady_tok_s"] < hi < 100_000, decision["reason"]
    suspected = decision["shift_suspected"]
    assert suspected["since_step"] == 611 and 81_000 < suspected["to_tok_s"] < 87_000
    assert suspected["from_tok_s"] == round(decision["steady_tok_s"], 1) and decision["level_shifts"] == []


REAL_LOG = Path(__file__).resolve().parent / "data" / "real" / "e2p-ps2-trees.log"  # labelled in tests/data/real/README.md
# steady at ~97.8k, declared 55 s in, then -14% to ~83.9k at step 615 (120 s) that holds (tests/data/probe/labels.csv)
SHIFT_LOG = Path(__file__).resolve().parent / "data" / "probe" / "late_drop-0.log"


def test_a_warm_up_cut_moved_after_the_declaration_is_shown_with_the_declaration_as_it_was():
    """e2p-ps2-trees is declared steady at step 520 with the warm-up ending at step 301; the re-run MSER later
    cuts the warm-up at step 1,341 and the figure follows. The lines printed said "steady at step 520" and
    "warm-up ended at step 1341": a steady state reached before its warm-up ended. Now they say both moments:
    the figure over steps 1,341..3,180, declared at step 520 with the warm-up ending at step 301 then. The JSON
    keeps warmup_end_step the cut now (where the figure's steps begin: dfo metrics and dfo report read it so),
    with the declaration's cut beside steady_declared_step."""
    result = invoke(REAL_LOG)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("steady at step 520")
    said = "over steps 1341..3180 (declared at step 520 with the warm-up ending at step 301 then)"
    assert said in lines[1] and said in lines[2], result.output
    for mention in re.finditer(r"warm-up end\w* at step (\d+)( then)?", result.output):
        assert int(mention[1]) <= 520 or mention[2], result.output  # a later cut is never the declaration's
    decision = json.loads(invoke(REAL_LOG, "--json").output)
    assert (decision["at_step"], decision["warmup_end_step"]) == (520, 1341)
    assert decision["evidence"]["steady_declared_warmup_end_step"] == 301
    assert decision["evidence"]["steady"]["figure_steps"] == [1341, 3180]




def test_timeline_json_is_one_decision_per_change_of_verdict_ending_with_the_plain_json():
    """`dfo replay LOG --json --timeline` on late_drop-0: one decision JSON line per change of verdict,
    each as the decision stood then (when, at what step, at what figure), and last exactly what `--json` alone
    prints (the same verdict as the change before it when nothing changed since); the exit status is the
    final verdict's."""
    result = invoke(SHIFT_LOG, "--json", "--timeline")
    plain = invoke(SHIFT_LOG, "--json")
    assert result.exit_code == plain.exit_code == 0, result.output
    changes = [json.loads(line) for line in result.output.splitlines()]
    assert len(changes) >= 3 and changes[-1] == json.loads(plain.output)
    assert changes[0]["decision"] == "undecided" and changes[0]["at_ts"] is not None
    for change in changes[:-1]:
        assert set(change) == set(changes[-1]) - {"malformed_lines"}  # the decision object, as today
    for change in changes:
        assert {"at_ts", "at_step", "steady_tok_s", "interval"} <= set(change)
        if change["decision"] == "steady":
            lo, hi = change["interval"]
            assert lo <= change["steady_tok_s"] <= hi and change["at_step"] is not None
    times = [change["at_ts"] for change in changes]
    assert times == sorted(times)
    verdicts = [(c["decision"], c["ended"], c["at_step"] if c["decision"] == "steady" else None) for c in changes[:-1]]
    assert all(a != b for a, b in zip(verdicts, verdicts[1:]))  # each line but the final one a change
    assert changes[-1]["decision"] == "steady" and abs(changes[-1]["steady_tok_s"] / 83_928 - 1) < 0.05


def test_timeline_table_has_a_row_per_change_with_its_time_step_and_figure():
    changes = [json.loads(line) for line in invoke(SHIFT_LOG, "--json", "--timeline").output.splitlines()]
    result = invoke(SHIFT_LOG, "--timeline")
    assert result.exit_code == 0, result.output
    changed = len(changes) - 2
    assert f"the verdict at the first line, {changed} change{'' if changed == 1 else 's'}, the end" in result.output
    rows = [line.split() for line in result.output.splitlines() if re.match(r"\s*(\d+|end)\s+\d\d:\d\d:\d\d\s", line)]
    names = [str(number) for number in range(1, len(changes))] + ["end"]
    assert [row[0] for row in rows] == names
    for row, change in zip(rows, changes):
        assert row[1] == change["at_ts"][11:19] and change["decision"] in row
        if change["decision"] == "steady":
            assert str(change["at_step"]) in row and f"{change['steady_tok_s']:,.0f}" in row
    for name, change in zip(names, changes):
        assert f"{name}: {change['at_ts']}: {change['reason'][:40]}" in result.output.replace("\n", "")


def test_timeline_on_a_crash_shows_the_crash_last_and_its_line_escaped(tmp_path):
    log = write_log(tmp_path / "run-x.log", extra=["Exception in thread Thread-2 (drafter\x1b[31m):", *TLS_CRASH[1:]])
    result = invoke(log, "--timeline")
    assert result.exit_code == 1 and "\x1b[31m" not in result.output
    assert "(drafter\\x1b[31m)" in result.output.replace("\n", "")  # the thread's name, its escape made visible
    rows = [line.split() for line in result.output.splitlines() if re.match(r"\s*(\d+|end)\s+\d\d:\d\d:\d\d", line)]
    assert [[word for word in row if word in COLOURS] for row in rows] == [["undecided"], ["steady"], ["crash"], ["crash"]]
    assert rows[-1][0] == "end" and "stop" in rows[-1]


def test_help_names_the_timeline():
    result = CliRunner().invoke(app, ["replay", "--help"])
    assert result.exit_code == 0 and "--timeline" in result.output and "change of verdict" in result.output


QUIET_LOG = Path(__file__).resolve().parent / "data" / "real" / "qwen-thr-nographs-cold.log"  # flat, refines after


def test_timeline_row_of_a_declaration_has_the_figure_it_was_declared_at_not_the_final_one():
    """The steady row is what --until-decided would have exited on: its figure is the one a replay of the log
    up to that line gives; the refined figure of the log's end comes after it, as the final line."""
    changes = [json.loads(line) for line in invoke(QUIET_LOG, "--json", "--timeline").output.splitlines()]
    declared = next(c for c in changes if c["decision"] == "steady")
    lines = QUIET_LOG.read_text().splitlines()
    upto = next(i for i, line in enumerate(lines) if line.startswith(f"ts={declared['at_ts']}"))
    then = replay(lines[: upto + 1], run=QUIET_LOG.stem)
    assert then.decision == "steady" and declared["steady_tok_s"] == pytest.approx(then.steady_tok_s)
    assert changes[-1]["steady_tok_s"] != declared["steady_tok_s"]  # the log's end refined it: both are listed
