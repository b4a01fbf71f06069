"""`dfo metrics NAME` and `dfo compare NAME NAME...` over a registry filled as the watcher fills it, through the
console script's entry point (tests/harness/cli.py) at 80 columns: the figures, the timeline, the JSON and real PNGs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy
import pytest
from harness import cli
from matplotlib import image

from orchestrator.logfmt import format_ts
from orchestrator.store import Run, Store

T0 = 1_800_000_000.0


def dfo(home: Path, *args: str) -> cli.Ran:
    """`dfo ARGS` on the registry in `home`, 80 columns wide."""
    return cli.dfo(*args, env={"DFO_HOME": str(home), "COLUMNS": "80"})


def add_run(store: Store, name: str, variant: str, level: float, decision: dict | None, *, gpus: int = 2) -> None:
    """100 s of a run: 20 s of warm-up at a tenth of `level`, then `level`; GPU samples every 5 s; its decisions."""
    store.add_run(Run(name=name, target="ct200", variant=variant, state="stopped", exit_code=143,
                      started_at=format_ts(T0), ended_at=format_ts(T0 + 100), decision=decision))
    store.add_event(name, "started", {"pid": 1, "target": "ct200", "variant": variant, "sets": {"batch_size": 8}},
                    at=format_ts(T0))
    store.add_samples(name, [{"step": 10 * k, "ts": T0 + 5 + k, "tok_s": level / 10 if k < 20 else level,
                              "loss": 3.0 - k / 50} for k in range(90)])
    for t in range(0, 100, 5):
        store.add_gpu_samples("ct200", [{"ts": T0 + t, "index": i, "mem_used_mib": 1000.0 * t + i,
                                         "mem_total_mib": 143771.0, "util_pct": 90.0} for i in range(gpus)], run=name)
    store.add_event(name, "decision", {"chain": name, "decision": {"decision": "undecided", "action": "none"}},
                    at=format_ts(T0 + 30))
    if decision:
        store.add_event(name, "decision", {"chain": name, "decision": decision}, at=format_ts(T0 + 60))


@pytest.fixture
def home(tmp_path):
    with Store(tmp_path / "dfo.db") as store:
        add_run(store, "trees-run", "trees", 900.0, {"decision": "steady", "action": "keep", "steady_tok_s": 900.0,
                                                     "interval": [882.0, 918.0], "warmup_end_step": 200, "at_step": 550})
        add_run(store, "nographs-run-with-a-rather-long-name", "nographs", 1100.0,
                {"decision": "undecided", "action": "none", "steady_tok_s": None, "interval": None})
    return tmp_path


def test_metrics_shows_the_figure_warmup_gpus_and_a_timeline_with_the_decisions(home):
    shown = dfo(home, "metrics", "trees-run")
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    assert max(map(len, out.splitlines())) <= 80
    assert "figure: steady 900 tok/s (95% 882-918), warm-up ended at step 200 after 25.0 s" in out
    assert "GPU 0: peak 95,000 of 143,771 MiB, mean utilisation 90%" in out and "GPU 1: peak 95,001" in out
    assert "loss: 3 -> 1.22" in out
    timeline = out[out.index("over time"):]
    assert "warm-up ends (step 200)" in timeline and "steady -> keep" in timeline
    assert "undecided" not in timeline  # the watcher's running "undecided" is not news


def test_metrics_counts_a_gpus_samples_with_the_noun_in_their_number(home):
    with Store(home / "dfo.db") as store:  # a third GPU sampled once, as when it joined the run late
        store.add_gpu_samples("ct200", [{"ts": T0 + 95, "index": 2, "mem_used_mib": 10.0, "mem_total_mib": 143771.0,
                                         "util_pct": 50.0}], run="trees-run")
    out = dfo(home, "metrics", "trees-run").stdout
    assert "GPU 2: peak 10 of 143,771 MiB, mean utilisation 50% (1 sample)" in out  # it said "(1 samples)"
    assert "GPU 0: peak 95,000 of 143,771 MiB, mean utilisation 90% (20 samples)" in out


def test_metrics_json_carries_every_series(home):
    shown = dfo(home, "metrics", "trees-run", "--json")
    data = json.loads(shown.stdout)
    assert len(data["samples"]) == 90 and data["samples"][0] == {"t": 5.0, "step": 0, "tok_s": 90.0, "loss": 3.0}
    assert sorted(data["gpu_samples"]) == ["0", "1"] and len(data["gpu_samples"]["0"]) == 20
    assert data["warmup_end"] == {"step": 200, "t": 25.0} and data["settings"] == {"batch_size": 8}
    assert [(d["t"], d["decision"]) for d in data["decisions"]] == [(30.0, "undecided"), (60.0, "steady")]
    assert (data["tok_s"], data["basis"], data["interval"]) == (900.0, "steady", [882.0, 918.0])


def test_metrics_of_an_undecided_run_labels_its_figure(home):
    out = " ".join(dfo(home, "metrics", "nographs-run-with-a-rather-long-name").stdout.split())  # lines wrap at 80
    assert "figure: 1,100 tok/s, median of the last 60 s of steps (undecided: not a steady figure)" in out


def test_metrics_plot_is_a_png_with_four_panels_of_data(home, tmp_path):
    png = tmp_path / "trees.png"
    shown = dfo(home, "metrics", "trees-run", "--plot", str(png))
    assert shown.returncode == 0, shown.stderr
    rgb = image.imread(png)[..., :3]
    assert rgb.shape[:2] == (900, 1200)
    coloured = (rgb.max(axis=2) - rgb.min(axis=2)) > 0.3
    rows_with_colour = numpy.nonzero(coloured.sum(axis=1) > 20)[0]
    assert rows_with_colour.max() - rows_with_colour.min() > 600  # data from the top panel to the bottom one


def test_compare_puts_runs_side_by_side_at_80_columns_and_overlays_their_throughput(home, tmp_path):
    png = tmp_path / "both.png"
    shown = dfo(home, "compare", "trees-run", "nographs-run-with-a-rather-long-name", "--plot", str(png))
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert max(map(len, lines)) <= 80
    trees = next(line for line in lines if "trees-run" in line)
    assert "900" in trees and "steady" in trees
    assert "not shown for lack of width: settings, ±95%, warm-up s, peak MiB" in " ".join(shown.stdout.split())
    nographs = next(line for line in lines if "1,100" in line)
    assert "last-win" in nographs and "undecided" in nographs
    assert "not a steady figure" in shown.stdout
    rgb = image.imread(png)[..., :3]
    blue = (numpy.abs(rgb - numpy.array((0.122, 0.467, 0.706))).max(axis=2) < 0.08).sum()
    orange = (numpy.abs(rgb - numpy.array((1.0, 0.498, 0.055))).max(axis=2) < 0.08).sum()
    assert blue > 200 and orange > 200  # one colour per run
    # a process of its own: in this process rich's console width is fixed by whichever test sized it first
    wide = cli.dfo_process("compare", "trees-run", "nographs-run-with-a-rather-long-name",
                           env={"DFO_HOME": str(home), "COLUMNS": "140"}).stdout
    trees = next(line for line in wide.splitlines() if "trees-run" in line)
    assert "batch_size=8" in trees and "18" in trees and "25" in trees and "95,001" in trees  # ±, warm-up s, peak
    data = json.loads(dfo(home, "compare", "trees-run", "nographs-run-with-a-rather-long-name", "--json").stdout)
    assert [(r["run"], r["basis"], r["peak_mem_mib"]) for r in data["runs"]] == [
        ("trees-run", "steady", 95001.0), ("nographs-run-with-a-rather-long-name", "last-window median", 95001.0)]


def test_compare_and_metrics_refuse_bad_names_in_one_line(home):
    one = dfo(home, "compare", "trees-run")
    assert one.returncode == 2 and "at least two run names" in one.stderr and len(one.stderr.strip().splitlines()) == 1
    missing = dfo(home, "metrics", "nope")
    assert missing.returncode == 2 and "no run named 'nope'" in missing.stderr and "Traceback" not in missing.stderr


REAL_LOG = Path(__file__).resolve().parent / "data" / "real" / "e2p-ps2-trees.log"  # labelled in tests/data/real/README.md


def add_real_run(store: Store, name: str, log: Path) -> None:
    """A run whose log is `log`, stored as the watcher stores it: its step lines as samples, a `decision` event
    at each decision that is news (decide.decision_key) on the log's own clock, the last decision on the row."""
    from orchestrator.decide import RunJudge
    from orchestrator.decide.replay import judged_lines
    from orchestrator.logfmt import StepRecord, parse_logfmt
    from orchestrator.decide import decision_key
    from orchestrator.watch import sample_of

    lines = log.read_text().splitlines()
    records = [r for r in map(parse_logfmt, lines) if isinstance(r, StepRecord)]
    store.add_run(Run(name=name, target="ct200", variant="ps2-trees", state="exited", exit_code=0,
                      started_at=format_ts(records[0].ts - 20)))
    store.add_samples(name, [sample_of(r) for r in records])
    judge, news = RunJudge(run=name), None
    for clock, _ in judged_lines(judge, lines):
        if news is None or decision_key(judge.decision()) != decision_key(news):
            news = judge.decision()
            store.add_event(name, "decision", {"chain": name, "decision": news.to_json()}, at=format_ts(clock))
    store.update_run(name, decision=judge.decision().to_json())


def test_metrics_timeline_puts_the_warm_up_end_at_the_declarations_cut_and_says_the_cut_moved_later(tmp_path):
    """e2p-ps2-trees is declared steady at step 520 with the warm-up ending at step 301; the re-run MSER later cuts
    it at step 1,341. The timeline said "warm-up ends (step 1341)" in a row after "steady -> keep": a steady
    state before its warm-up ended. Now the warm-up ends where the declaration put it, before the verdict, and
    the row where the figure's steps begin says the cut moved there."""
    with Store(tmp_path / "dfo.db") as store:
        add_real_run(store, "e2p", REAL_LOG)
    shown = dfo(tmp_path, "metrics", "e2p")
    assert shown.returncode == 0, shown.stderr
    out = " ".join(shown.stdout.split())  # rows wrap at 80 columns
    assert ("figure: steady 31,368 tok/s (95% 30,273-32,463) over steps 1341..3180 (declared at step 520 with the "
            "warm-up ending at step 301 then); warm-up 66.8 s to the cut now") in out, shown.stdout
    timeline = out[out.index("over time"):]
    ends, steady = timeline.index("warm-up ends (step 301)"), timeline.index("steady -> keep")
    moved = timeline.index("warm-up cut moved later to step 1341: the figure is over steps 1341..3180")
    assert ends < steady < moved and "warm-up ends (step 1341)" not in timeline, shown.stdout
    data = json.loads(dfo(tmp_path, "metrics", "e2p", "--json").stdout)
    assert (data["warmup_end"]["step"], data["declared_warmup_end"]["step"], data["figure_steps"]) == (1341, 301, [1341, 3180])
    assert data["declared_warmup_end"]["t"] < [d["t"] for d in data["decisions"] if d["decision"] == "steady"][0]


def test_metrics_of_a_run_with_one_metric_line_says_1_metric_line(tmp_path):
    """A run stopped after its first step line: `dfo metrics` says how many lines it holds in the noun's number."""
    with Store(tmp_path / "dfo.db") as store:
        store.add_run(Run(name="short-run", target="ct200", variant="trees", state="stopped", exit_code=143,
                          started_at=format_ts(T0), ended_at=format_ts(T0 + 10)))
        store.add_samples("short-run", [{"step": 10, "ts": T0 + 5, "tok_s": 900.0, "loss": 3.0}])
    shown = dfo(tmp_path, "metrics", "short-run")
    assert shown.returncode == 0, shown.stderr
    assert "1 metric line, up to step 10" in " ".join(shown.stdout.split())  # it said "1 metric lines"
