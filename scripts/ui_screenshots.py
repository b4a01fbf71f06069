"""Screenshots of `dfo ui` for docs/ui.md: a registry filled from recorded trainer logs, a real `dfo ui`
process over it, Debian's chromium driven by Playwright (the browser tests' tooling).

    .venv/bin/python scripts/ui_screenshots.py docs/ui

The registry (a temporary DFO_HOME) is filled through the store API the watcher uses: each run's metric
lines from a real log of tests/data/real (parsed by logfmt, as a watch parses them), its verdict from
decide/replay (the watcher's judge over the same lines), a decision event at the time it was reached, and
GPU memory per GPU from the lines' own `mem_gb`. A crashed CUDA-graph run fell back to nographs; two cells of
a batch measured trees and nographs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from orchestrator.batch import CellTable
from orchestrator.decide import replay
from orchestrator.experiments import parse_experiments
from orchestrator.inventory import parse_inventory
from orchestrator.logfmt import StepRecord, format_ts, make_parser
from orchestrator.store import Run, Store

REPO = Path(__file__).resolve().parent.parent
REAL = REPO / "tests" / "data" / "real"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
INVENTORY = parse_inventory(textwrap.dedent("""
    hosts:
      local: {transport: local, containers: {here: {ctid: null}}}
    variants:
      trees: {compile: trees, preset: h200-small}
      nographs: {compile: nographs, preset: h200-small}
    fallback: [trees, nographs]
"""))


def add_logged_run(store: Store, logs: Path, name: str, log: str, *, variant: str, ended_ago_s: float | None,
                   parent: str | None = None, batch: str | None = None, chain: list[str] | None = None,
                   exit_code: int | None = 75, state: str = "stopped") -> None:
    """A run on the local target `here` whose log is a copy of a real one, its clock moved so that it ended
    `ended_ago_s` ago (None: it is still running, its last line a few seconds ago)."""
    text = (REAL / log).read_text(errors="replace")
    lines = text.splitlines()
    parse = make_parser(None)
    records = [parse(line, None) for line in lines]
    stamps = [r.ts for r in records if getattr(r, "ts", None) is not None]
    shift = time.time() - (ended_ago_s if ended_ago_s is not None else 3.0) - stamps[-1]
    steps = [r for r in records if isinstance(r, StepRecord)]
    start, end = stamps[0] + shift - 20, stamps[-1] + shift + 1
    decision = replay(lines, run=name, variant=variant, chain=chain or (), exit_code=exit_code,
                      end_ts=end - shift if exit_code is not None else None).to_json()
    log_path = logs / f"{name}.log"
    log_path.write_text(text)
    store.add_run(Run(name=name, target="here", host="local", variant=variant, state=state, exit_code=exit_code,
                      started_at=format_ts(start), ended_at=format_ts(end) if exit_code is not None else None,
                      parent=parent, batch=batch, chain=chain, decision=decision, log_path=str(log_path), pid=4242))
    store.add_event(name, "launched", {"pid": 4242, "target": "here", "variant": variant, "sets": {}}, at=format_ts(start))
    store.add_samples(name, [{"step": s.step, "ts": s.ts + shift, "tok_s": s.tok_s, "loss": s.loss, "phase": s.phase}
                             for s in steps])
    store.add_gpu_samples("here", [{"ts": s.ts + shift, "index": gpu, "mem_used_mib": s.mem_gb * 1024 / 2,
                                    "mem_total_mib": 143771.0, "util_pct": None}
                                   for s in steps if s.mem_gb is not None for gpu in (0, 1)], run=name)
    at = next((s.ts for s in steps if s.step >= (decision.get("at_step") or 0)), stamps[-1])
    store.add_event(name, "decision", {"chain": name, "decision": decision}, at=format_ts(at + shift))


def fill(store: Store, logs: Path) -> dict[str, str]:
    """The demo registry; returns the names the screenshots open."""
    add_logged_run(store, logs, "train_trees_20261203-0912", "small-thr-localtls-g1.log", variant="trees",
                   chain=["nographs"], exit_code=1, state="crashed", ended_ago_s=600)
    add_logged_run(store, logs, "train_trees_20261203-0912.2-nographs", "small-thr-nographs-g1.log",
                   variant="nographs", parent="train_trees_20261203-0912", chain=[], ended_ago_s=240)
    add_logged_run(store, logs, "train_eager_20261203-0931", "small-thr-eager.log", variant="eager", exit_code=None,
                   state="running", ended_ago_s=None)
    plan = parse_experiments("batch: compile-sweep\ntargets: [here]\nmatrix: {variant: [trees, nographs]}\n", INVENTORY)
    table = CellTable(store)
    table.save_plan(plan, format_ts(time.time() - 3600))
    for cell, log, ago in (("trees.here.r1", "qwen-thr-trees-cold.log", 3000),
                           ("nographs.here.r1", "qwen-thr-nographs-cold.log", 2700)):
        name = f"compile-sweep.{cell}"
        add_logged_run(store, logs, name, log, variant=cell.split(".")[0], batch="compile-sweep", ended_ago_s=ago)
        table.update("compile-sweep", cell, state="done", root_run=name, gpu_ids=[0, 1], outcome={"why": "stop_when steady"})
    return {"run": "train_trees_20261203-0912.2-nographs", "batch": "compile-sweep"}


def main(out: Path) -> None:
    from playwright.sync_api import sync_playwright

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as home:
        with Store(Path(home) / "dfo.db") as store:
            names = fill(store, Path(home))
        env = {**os.environ, "DFO_HOME": home}
        server = subprocess.Popen([str(Path(sys.executable).parent / "dfo"), "ui", "--port", "0", "--no-refresh"], env=env,
                                  stdout=subprocess.PIPE, text=True)
        try:
            url = server.stdout.readline().strip().rstrip("/")
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
                page = browser.new_page(viewport={"width": 1100, "height": 300})
                for path, file in (("/", "runs.png"), (f"/runs/{names['run']}", "run.png"),
                                   (f"/batches/{names['batch']}", "batch.png")):
                    page.goto(url + path)
                    page.wait_for_load_state("networkidle")
                    page.screenshot(path=str(out / file), full_page=True)
                    print(out / file, (out / file).stat().st_size, "bytes")
                browser.close()
        finally:
            server.terminate()
            server.wait(timeout=10)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/ui"))
