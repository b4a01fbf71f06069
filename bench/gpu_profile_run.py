"""Where a real training run's GPU time goes: the threaded trainer as `python -m trainer` runs it, profiled
for a few steps once it is warm, every stream at once (the target's and each drafter's).

    python3 bench/gpu_profile_run.py --out $OUT --variant trees                 # qwen3-8b-shape, one GPU
    python3 bench/gpu_profile_run.py --out $OUT --variant nographs --set data.batch=4
    python3 bench/gpu_profile_run.py --out /tmp/p --preset tiny-cpu --variant eager --warm 3 --steps 2  # CPU dry run

It builds the run exactly as the trainer's threads topology does (trainer.pipeline.ThreadedRun), lets it
train --warm steps (compilation included), then records a torch.profiler trace of the next --steps steps
and prints (and appends to OUT/profile.jsonl) per sample:
  - the window's GPU span and the time some kernel was running on some stream (the union of kernel
    intervals): span - busy is time the GPU sat idle (launch gaps, host-side waits);
  - each stream's kernel time by category (matmul, attention, optimizer, reduction/elementwise, copies),
    so the target's share is told from the drafter's;
  - the longest idle gaps, and the top kernels by total time.
MFU figures use trainer/flops.py (the same count as docs/benchmarks.md). The trace itself is written to
OUT/trace.json.gz (open it in Perfetto). On a machine without CUDA the trace holds CPU ops only; the
dry run checks the plumbing, its figures mean nothing.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import shutil
import time
from collections import defaultdict
from pathlib import Path

PEAK = 989e12
CATEGORIES = (  # first match wins; names as CUPTI reports them (cuBLAS, cuDNN, FlashAttention, Triton)
    ("attention", re.compile(r"flash|fmha|flex|attention|sdpa|cudnn", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|xmma|nvjet|sm90_|sm100_|matmul|triton_tem", re.I)),
    ("optimizer", re.compile(r"multi_tensor_apply|foreach|adam", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy_kernel|CatArrayBatched|direct_copy", re.I)),
    ("reduction", re.compile(r"red_|reduce|reduction|per_fused.*red|argmax|logsumexp|norm", re.I)),
    ("elementwise", re.compile(r"triton_|elementwise|vectorized|unrolled", re.I)),
)


def category(name: str) -> str:
    for label, pattern in CATEGORIES:
        if pattern.search(name):
            return label
    return "other"


def idle_gaps(intervals: list[tuple[float, float]]) -> list[float]:
    """Lengths of the gaps between merged intervals, longest first (the span less their sum is the time some
    interval covers)."""
    gaps, current_end = [], None
    for start, end in sorted(intervals):
        if current_end is not None and start > current_end:
            gaps.append(start - current_end)
        current_end = end if current_end is None else max(current_end, end)
    return sorted(gaps, reverse=True)


def summarise(events: list[dict], samples: int, flops_per_sample: float, top: int = 25) -> dict:
    """Figures of one profiled window from chrome-trace events (device kernels, memcpy, memset): times in
    ms per sample, `samples` being the training samples the window trained."""
    device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    if not device:  # a CPU-only trace (dry run): its top-level ops stand in for kernels
        device = [e for e in events if e.get("cat") == "cpu_op" and "dur" in e]
    intervals = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in device]
    if not intervals:  # CPU ops of threads started before the profiler are not recorded
        return {"error": "no device events in the trace (expected on a machine without CUDA)"}
    span_us = max(end for _, end in intervals) - min(start for start, _ in intervals)
    gaps = idle_gaps(intervals)
    busy_us = span_us - sum(gaps)
    per_stream: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    per_kernel: dict[str, float] = defaultdict(float)
    for event in device:
        stream = str((event.get("args") or {}).get("stream", event.get("tid", "?")))
        per_stream[stream][category(event["name"])] += float(event["dur"])
        per_kernel[event["name"][:100]] += float(event["dur"])
    per = 1e3 * max(samples, 1)  # us -> ms per sample
    span_ms = span_us / per
    kernel_sum = sum(sum(c.values()) for c in per_stream.values())
    return {
        "samples": samples, "span_ms": round(span_ms, 2), "busy_ms": round(busy_us / per, 2),
        "idle_ms": round((span_us - busy_us) / per, 2), "kernel_sum_ms": round(kernel_sum / per, 2),
        "mfu_span": round(flops_per_sample / (span_ms / 1e3) / PEAK, 3) if span_ms else None,
        "streams": {s: {c: round(v / per, 2) for c, v in sorted(cats.items(), key=lambda kv: -kv[1])}
                    | {"total": round(sum(cats.values()) / per, 2)}
                    for s, cats in sorted(per_stream.items(), key=lambda kv: -sum(kv[1].values()))},
        "gaps_ms": [round(g / 1e3, 3) for g in gaps[:12]],
        "gaps_over_50us_ms_per_sample": round(sum(g for g in gaps if g > 50) / per, 2),
        "top": [(name, round(us / per, 3)) for name, us in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top]],
    }


def emit(out: Path, **fields) -> None:
    line = json.dumps(fields)
    print(line, flush=True)
    with open(out / "profile.jsonl", "a") as fh:
        fh.write(line + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--preset", default="qwen3-8b-shape")
    parser.add_argument("--variant", default="trees")
    parser.add_argument("--warm", type=int, default=20, help="steps trained before the profiled window")
    parser.add_argument("--steps", type=int, default=6, help="steps profiled")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    import torch
    from torch.profiler import ProfilerActivity, profile

    from trainer.config import build_config
    from trainer.data import build_source
    from trainer.flops import flops_per_sample
    from trainer.metrics import MetricLog
    from trainer.pipeline import RunState, ThreadedRun

    steps = args.warm + args.steps + 3
    cfg = build_config(args.preset, [f"run.compile={args.variant}", f"run.steps={steps}", "run.checkpoint_every=0",
                                     f"run.out={args.out / 'runs'}", *args.overrides])
    log = MetricLog()
    state = RunState()
    run_dir = args.out / "runs" / "profile"
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    pipeline = ThreadedRun(cfg, build_source(cfg), log, run_dir, False, state)
    pipeline.start()
    emit(args.out, part="run", preset=args.preset, variant=args.variant, overrides=args.overrides,
         torch=torch.__version__, gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
         build_s=round(time.monotonic() - started, 1))

    def wait_for(step: int) -> bool:
        while pipeline.done_step < step:
            if state.failed.is_set() or not any(w.is_alive() for w in pipeline.workers):
                return False
            time.sleep(0.002)
        return True

    if not wait_for(args.warm):
        emit(args.out, part="run", error=f"the run ended before step {args.warm}: {state.failure}")
        raise SystemExit(1)
    activities = [ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        first = pipeline.done_step
        wait_for(first + args.steps)
        last = pipeline.done_step
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    state.stop_requested.set()
    trace = args.out / "trace.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text()).get("traceEvents", [])
    with open(trace, "rb") as src, gzip.open(args.out / "trace.json.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    trace.unlink()
    samples = (last - first) * cfg.data.batch * len(cfg.run.drafter_devices)
    flops = flops_per_sample(cfg)
    emit(args.out, part="window", steps=[first, last], **summarise(events, samples, flops["total"]))
    emit(args.out, part="flops", **{k: round(v / 1e12, 2) for k, v in flops.items()},
         ideal_ms_at_75pct={k: round(v / (0.75 * PEAK) * 1e3, 1) for k, v in flops.items()})
    pipeline.wait()


if __name__ == "__main__":
    main()
