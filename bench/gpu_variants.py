"""GPU benchmark of the trainer: every compile strategy on one GPU, then throughput, MFU and a profile.

Prints figures, asserts nothing. Each run is `python -m trainer ...` in a subprocess with a timeout, so a
crashing strategy is recorded (exit code + the last lines of its traceback) and the next one runs.

    python3 bench/gpu_variants.py --out $OUT \\
        --matrix h200-small:threads:eager,nographs,notrees,trees,localtls \\
        --matrix qwen3-8b-shape:threads:nographs --profile qwen3-8b-shape:threads:nographs

Each --matrix is PRESET:TOPOLOGY:VARIANT[,VARIANT...]. Writes OUT/results.md (table), OUT/results.json,
OUT/all.log (every run's full output) and, with --profile, OUT/profile.txt (torch.profiler, GPU time by op).
MFU = samples/s x counted FLOPs per sample (trainer/flops.py) / 989 TFLOP/s (H200 dense bf16 datasheet).
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.config import build_config  # noqa: E402
from trainer.flops import flops_per_sample  # noqa: E402

PEAK_FLOPS = 989e12
STEPS = {"tiny-cpu": 400, "h200-small": 200, "qwen3-8b-shape": 30}


def parse_fields(line: str) -> dict[str, str]:
    fields = {}
    for part in line.split():
        key, sep, value = part.partition("=")
        if sep:
            fields[key] = value.strip('"')
    return fields


def device_overrides(preset: str, topology: str) -> list[str]:
    """One GPU: threads = 1 target + 2 drafter threads (qwen: 1); procsplit = 1 target + 1 drafter process
    (NCCL cannot put two ranks on one GPU)."""
    sets = [f"run.topology={topology}", "run.targets=cuda:0"]
    if preset == "tiny-cpu":
        sets += ["run.log_every=20", "run.warmup_log_steps=20"]
    two = topology == "threads" and preset != "qwen3-8b-shape"
    return sets + ["run.drafters=cuda:0,cuda:0" if two else "run.drafters=cuda:0"]


def failure_text(output: str) -> str:
    """The lines that say what killed a run: the last traceback's final lines, or the error event."""
    lines = [line for line in output.splitlines() if line.strip()]
    errors = [i for i, line in enumerate(lines) if "Error" in line or "error" in line.split("=")[0]]
    if not errors:
        return " / ".join(lines[-3:])
    last = errors[-1]
    return " / ".join(lines[max(0, last - 3): last + 1])[-600:]


def summarise(preset: str, topology: str, variant: str, code: int | None, output: str, wall: float) -> dict:
    cfg = build_config(preset, device_overrides(preset, topology))
    steps = [parse_fields(line) for line in output.splitlines() if " event=step " in line]
    train = [float(s["tok_s"]) for s in steps if s.get("phase") == "train"][1:]
    compiles = [float(parse_fields(line)["seconds"]) for line in output.splitlines() if " event=compile " in line]
    tok_s = statistics.median(train) if train else None
    samples_s = tok_s / cfg.data.seq_len if tok_s else None
    flops = flops_per_sample(cfg)["total"]
    return {
        "preset": preset, "topology": topology, "variant": variant,
        "status": "ok" if code == 0 else ("timeout" if code is None else f"exit {code}"),
        "steady_tok_s": tok_s, "samples_s": samples_s,
        "mfu": samples_s * flops / PEAK_FLOPS if samples_s else None,
        "tflops_per_sample": flops / 1e12, "compile_s": max(compiles) if compiles else None,
        "last_loss": steps[-1].get("loss") if steps else None, "mem_gb": steps[-1].get("mem_gb") if steps else None,
        "wall_s": round(wall, 1), "failure": "" if code == 0 else failure_text(output),
    }


def run_one(preset: str, topology: str, variant: str, timeout: float, log) -> dict:
    cmd = [sys.executable, "-m", "trainer", "--preset", preset, "--variant", variant, "--wandb", "off",
           "--steps", str(STEPS.get(preset, 100)), "--run-name", f"{preset}-{topology}-{variant}",
           "--out", "/tmp/bench-runs"]
    for assignment in device_overrides(preset, topology):
        cmd += ["--set", assignment]
    env = dict(os.environ, PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0", TORCH_LOGS="recompiles")
    started = time.monotonic()
    # Its own session, so a timeout kills the whole group: procsplit's worker processes hold GPU memory and
    # would outlive a kill of the parent alone (seen on the H200: a 31 GB orphan failed the next benchmark).
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=Path(__file__).resolve().parents[1], start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        code = None
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
    log.write(f"\n===== {preset} {topology} {variant} exit={code} =====\n$ {' '.join(cmd)}\n{output}\n")
    log.flush()
    row = summarise(preset, topology, variant, code, output, time.monotonic() - started)
    print(json.dumps(row), flush=True)
    return row


def profile(preset: str, topology: str, variant: str, out: Path) -> None:
    """Run the threaded trainer in this process under torch.profiler; write GPU time by op."""
    import io

    import torch
    from torch.profiler import ProfilerActivity

    from trainer.data import build_source
    from trainer.metrics import MetricLog
    from trainer.pipeline import ThreadedRun

    warm, window = 6, 5
    cfg = build_config(preset, device_overrides(preset, topology) + [f"run.compile={variant}", "run.steps=14"])
    stream = io.StringIO()
    pipeline = ThreadedRun(cfg, build_source(cfg), MetricLog(stream), Path("/tmp/bench-profile"), False)
    prof = torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    pipeline.start()
    wait_for_step(pipeline, warm)
    torch.cuda.synchronize()
    prof.start()
    started = time.monotonic()
    wait_for_step(pipeline, warm + window)
    torch.cuda.synchronize()
    seconds = time.monotonic() - started
    prof.stop()
    status = pipeline.wait()
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=60)
    (out / "profile.txt").write_text(
        f"{preset} {topology} {variant} exit={status}; profiled steps {warm}..{warm + window}: "
        f"{seconds / window:.3f} s/step under the profiler\n{stream.getvalue()}\n{table}\n")


def wait_for_step(pipeline, step: int) -> None:
    while pipeline.done_step < step and not pipeline.state.failed.is_set():
        time.sleep(0.005)


def markdown(rows: list[dict]) -> str:
    head = "| preset | topology | variant | status | steady tok/s | samples/s | MFU | compile s | loss | mem GB | failure |"
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        fmt = lambda v, spec: format(v, spec) if isinstance(v, (int, float)) else "-"  # noqa: E731
        lines.append(
            f"| {r['preset']} | {r['topology']} | {r['variant']} | {r['status']} | {fmt(r['steady_tok_s'], ',.0f')} "
            f"| {fmt(r['samples_s'], '.2f')} | {fmt(r['mfu'], '.1%')} | {fmt(r['compile_s'], '.1f')} "
            f"| {r['last_loss'] or '-'} | {r['mem_gb'] or '-'} | {r['failure'].replace('|', '/')[:300]} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-out")))
    parser.add_argument("--matrix", action="append", default=[], help="PRESET:TOPOLOGY:V1,V2")
    parser.add_argument("--profile", default="", help="PRESET:TOPOLOGY:VARIANT to profile in-process")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per run")
    parser.add_argument("--qwen-timeout", type=float, default=240.0)
    parser.add_argument("--budget", type=float, default=1e9, help="start no run after this many seconds")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows, began = [], time.monotonic()
    with open(args.out / "all.log", "a") as log:
        for spec in args.matrix:
            preset, topology, variants = spec.split(":")
            limit = args.qwen_timeout if preset == "qwen3-8b-shape" else args.timeout
            for variant in variants.split(","):
                if time.monotonic() - began > args.budget:
                    print(f"skipped {preset} {topology} {variant}: over --budget", flush=True)
                    continue
                rows.append(run_one(preset, topology, variant, limit, log))
                (args.out / "results.md").write_text(markdown(rows))
                (args.out / "results.json").write_text(json.dumps(rows, indent=1))
    if args.profile and time.monotonic() - began < args.budget:
        profile(*args.profile.split(":"), args.out)


if __name__ == "__main__":
    main()
