"""Summarise trainer logs: steady tok/s (median of the second half of the step lines), samples/s, MFU
per GPU against the H200's 989 TFLOP/s dense bf16
(GPUs = the distinct cuda devices of the start line's targets and drafters), seconds from event=start to the first step, compile seconds.
    python bench/qwen_summary.py LOG... [--preset qwen3-8b-shape]
Prints a Markdown table. Reads logs only (no torch)."""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainer.config import build_config  # noqa: E402
from trainer.flops import flops_per_sample  # noqa: E402

PEAK = 989e12
FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')


def parse(path: Path) -> dict:
    start = first = None
    steps, compiles, done, gpus = [], [], "", 1
    for line in path.read_text(errors="replace").splitlines():
        if not line.startswith("ts="):
            continue
        fields = dict(FIELD.findall(line))
        ts = datetime.fromisoformat(fields["ts"].replace("Z", "+00:00"))
        event = fields.get("event")
        if event == "start":
            start = ts
            devices = {d for key in ("targets", "drafters") for d in fields.get(key, "").split(",") if d}
            gpus = max(1, len({d for d in devices if d.startswith("cuda")}))
        elif event == "compile":
            compiles.append(float(fields["seconds"]))
        elif event == "step":
            first = first or ts
            if fields.get("phase") != "warmup":
                steps.append(float(fields["tok_s"]))
        elif event in ("done", "error"):
            done = f"{event} {fields.get('reason', '')[:40]}"
    half = steps[len(steps) // 2:]
    return {"steady": statistics.median(half) if half else None, "lines": len(steps),
            "first_step_s": (first - start).total_seconds() if first and start else None,
            "compile_s": max(compiles) if compiles else None, "end": done, "gpus": gpus}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("logs", nargs="+", type=Path)
    parser.add_argument("--preset", default="qwen3-8b-shape")
    args = parser.parse_args()
    cfg = build_config(args.preset, [])
    flops, seq = flops_per_sample(cfg)["total"], cfg.data.seq_len  # tok_s counts every sample's tokens
    print("| log | GPUs | step lines | steady tok/s | samples/s | MFU per GPU (989) | first step after start | compile s | end |")
    print("|---|---|---|---|---|---|---|---|---|")
    for path in args.logs:
        r = parse(path)
        sps = r["steady"] / seq if r["steady"] else None
        cell = lambda v, f: format(v, f) if v is not None else "-"  # noqa: E731
        print(f"| {path.stem} | {r['gpus']} | {r['lines']} | {cell(r['steady'], ',.0f')} | {cell(sps, '.2f')} "
              f"| {cell(sps * flops / PEAK / r['gpus'] if sps else None, '.1%')} | {cell(r['first_step_s'], '.1f')} s "
              f"| {cell(r['compile_s'], '.1f')} | {r['end']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
