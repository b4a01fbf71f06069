"""Multi-GPU trainer figures (issue 8): threaded and procsplit across GPUs, replica hashes, 1 -> 2 GPU scaling.

Prints one JSON row per run and writes OUT/multi.json + OUT/multi.md; asserts nothing. Each run is
`python -m trainer` in its own process group with a timeout (the whole group is killed on expiry, so a
procsplit child never outlives its case); cases start only while --budget seconds remain.

    python3 bench/gpu_multi.py --out $OUT --phase eager --budget 120       # (a)+(b) with eager
    python3 bench/gpu_multi.py --out $OUT --phase compiled --budget 80     # nographs threads, trees procsplit
    python3 bench/gpu_multi.py --out /tmp/x --phase eager --cpu            # dry run: tiny-cpu on cpu "devices"

Steady tok/s = median of the phase=train step lines after the first (bench/gpu_variants.py's rule); per GPU =
that / the number of distinct drafter devices. Scaling = procsplit tok/s on 2 drafter GPUs (a target and a
drafter process on each) / on 1 (target and drafter sharing cuda:0); goal >= 1.8x.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_variants import failure_text, parse_fields  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GRACE_S = 10  # after the budget's deadline a running case still gets its own timeout, never more


@dataclass(frozen=True)
class Case:
    name: str
    topology: str
    variant: str
    targets: str
    drafters: str
    steps: int
    timeout_s: float


PHASES = {
    "eager": [
        Case("threads-t0-d1d1", "threads", "eager", "cuda:0", "cuda:1,cuda:1", 300, 75),
        Case("threads-t0-d0d1", "threads", "eager", "cuda:0", "cuda:0,cuda:1", 300, 75),
        Case("procsplit-1gpu", "procsplit", "eager", "cuda:0", "cuda:0", 300, 75),
        Case("procsplit-2gpu", "procsplit", "eager", "cuda:0,cuda:1", "cuda:0,cuda:1", 400, 75),
    ],
    "compiled": [
        Case("threads-t0-d0d1", "threads", "nographs", "cuda:0", "cuda:0,cuda:1", 300, 100),
        Case("procsplit-1gpu", "procsplit", "trees", "cuda:0", "cuda:0", 300, 100),
        Case("procsplit-2gpu", "procsplit", "trees", "cuda:0,cuda:1", "cuda:0,cuda:1", 400, 100),
        Case("threads-t0-d1d1", "threads", "nographs", "cuda:0", "cuda:1,cuda:1", 300, 100),
    ],
}


def on_cpu(case: Case) -> Case:
    """The dry run's version of a case: cpu for every cuda device, few steps."""
    cpu = lambda devices: ",".join("cpu" for _ in devices.split(","))  # noqa: E731
    return Case(case.name, case.topology, case.variant, cpu(case.targets), cpu(case.drafters), 40, 240)


def command(case: Case, preset: str) -> list[str]:
    log_every = 20 if preset == "h200-small" else 5
    return [sys.executable, "-m", "trainer", "--preset", preset, "--variant", case.variant, "--wandb", "off",
            "--topology", case.topology, "--steps", str(case.steps), "--run-name", f"multi-{case.name}-{case.variant}",
            "--out", "/tmp/bench-multi-runs", "--targets", case.targets, "--drafters", case.drafters,
            "--log-every", str(log_every), "--warmup-log-steps", str(log_every)]


def run_case(case: Case, preset: str, timeout_s: float, log) -> dict:
    cmd = command(case, preset)
    env = dict(os.environ, PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0")
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the run's own group: the supervisor and every child it spawned
        output, _ = proc.communicate(timeout=10)
        code = None
    log.write(f"\n===== {case.name} {case.topology} {case.variant} exit={code} =====\n$ {' '.join(cmd)}\n{output}\n")
    log.flush()
    return summarise(case, code, output, time.monotonic() - started)


def summarise(case: Case, code: int | None, output: str, wall: float) -> dict:
    lines = output.splitlines()
    steps = [parse_fields(line) for line in lines if " event=step " in line]
    train = [float(s["tok_s"]) for s in steps if s.get("phase") == "train"][1:]
    done = [parse_fields(line) for line in lines if " event=done " in line]
    compiles = [float(parse_fields(line)["seconds"]) for line in lines if " event=compile " in line]
    tok_s = statistics.median(train) if train else None
    gpus = len(set(case.drafters.split(",")))
    return {
        "case": case.name, "topology": case.topology, "variant": case.variant, "targets": case.targets,
        "drafters": case.drafters, "status": "ok" if code == 0 else ("timeout" if code is None else f"exit {code}"),
        "steady_tok_s": tok_s, "tok_s_per_gpu": tok_s / gpus if tok_s else None, "train_lines": len(train),
        "replicas": done[0].get("replicas") if done else None,
        "replica_hashes": done[0].get("replica_hashes") if done else None,
        "compile_s": max(compiles) if compiles else None, "mem_gb": steps[-1].get("mem_gb") if steps else None,
        "last_loss": steps[-1].get("loss") if steps else None, "wall_s": round(wall, 1),
        "failure": "" if code == 0 else failure_text(output),
    }


def scaling(rows: list[dict]) -> list[str]:
    """`procsplit VARIANT: 2 GPUs / 1 GPU = 1.93x` per variant measured both ways."""
    notes = []
    for variant in sorted({r["variant"] for r in rows}):
        by_case = {r["case"]: r["steady_tok_s"] for r in rows if r["variant"] == variant}
        one, two = by_case.get("procsplit-1gpu"), by_case.get("procsplit-2gpu")
        if one and two:
            notes.append(f"procsplit {variant}: 2 GPUs {two:,.0f} / 1 GPU {one:,.0f} tok/s = {two / one:.2f}x "
                         f"(goal >= 1.8x: {'met' if two / one >= 1.8 else 'NOT met'})")
    return notes


def markdown(rows: list[dict]) -> str:
    fmt = lambda v, spec: format(v, spec) if isinstance(v, (int, float)) else "-"  # noqa: E731
    lines = ["| case | topology | variant | targets | drafters | status | steady tok/s | per GPU | compile s "
             "| replicas | replica_hashes | failure |", "|" + "---|" * 12]
    for r in rows:
        lines.append(f"| {r['case']} | {r['topology']} | {r['variant']} | {r['targets']} | {r['drafters']} "
                     f"| {r['status']} | {fmt(r['steady_tok_s'], ',.0f')} | {fmt(r['tok_s_per_gpu'], ',.0f')} "
                     f"| {fmt(r['compile_s'], '.1f')} | {r['replicas'] or '-'} | {r['replica_hashes'] or '-'} "
                     f"| {r['failure'].replace('|', '/')[:300]} |")
    return "\n".join(lines + [""] + scaling(rows)) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-out")))
    parser.add_argument("--phase", choices=sorted(PHASES), required=True)
    parser.add_argument("--budget", type=float, default=1e9, help="start no case after this many seconds")
    parser.add_argument("--cpu", action="store_true", help="dry run: tiny-cpu preset on cpu devices")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    preset = "tiny-cpu" if args.cpu else "h200-small"
    results = args.out / "multi.json"
    rows = json.loads(results.read_text()) if results.exists() else []  # phases add to one table
    deadline = time.monotonic() + args.budget
    with open(args.out / "multi.log", "a") as log:
        for case in PHASES[args.phase]:
            case = on_cpu(case) if args.cpu else case
            left = deadline - time.monotonic()
            if left < min(30.0, case.timeout_s):
                print(f"skipped {case.name} {case.variant}: {left:.0f} s of the budget left", flush=True)
                continue
            row = run_case(case, preset, min(case.timeout_s, left + GRACE_S), log)
            print(json.dumps(row), flush=True)
            rows.append(row)
            results.write_text(json.dumps(rows, indent=1))
            (args.out / "multi.md").write_text(markdown(rows))
    for note in scaling(rows):
        print(note, flush=True)


if __name__ == "__main__":
    main()
