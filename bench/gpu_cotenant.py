"""A co-tenant on the same GPU as a training run, to record real logs whose throughput moves.

It keeps the GPU busy for a chosen share of each 100-ms window (bf16 matmuls, then a sleep), following a
schedule given in seconds since this script started, so a run beside it loses roughly that share of its
GPU time while it is busy. Used by bench/record_shapes.sh to record, on a real H200, the shapes the verdict
rule must handle: a drop that holds, a slow leak, periodic pauses.

    python3 bench/gpu_cotenant.py hold  --at 70 --duty 0.15 --until 150       # a 15% share from t=70 s
    python3 bench/gpu_cotenant.py ramp  --at 40 --duty 0.35 --until 160       # 0 -> 35% from t=40 s to the end
    python3 bench/gpu_cotenant.py pulse --at 30 --on 2 --every 12 --until 120  # the whole GPU 2 s in every 12 s

It prints one line per second (t, duty) so the recording keeps what it did.
"""

from __future__ import annotations

import argparse
import time

import torch

WINDOW_S = 0.1


def duty_at(mode: str, t: float, a: argparse.Namespace) -> float:
    if t < a.at:
        return 0.0
    if mode == "hold":
        return a.duty
    if mode == "ramp":
        return a.duty * min(1.0, (t - a.at) / max(a.until - a.at, 1e-9))
    # pulse: the whole GPU for `on` seconds at the start of every `every`-second period
    return 1.0 if (t - a.at) % a.every < a.on else 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["hold", "ramp", "pulse"])
    p.add_argument("--at", type=float, required=True, help="seconds after start when the schedule begins")
    p.add_argument("--until", type=float, required=True, help="seconds after start when the script exits")
    p.add_argument("--duty", type=float, default=0.15, help="share of each 100-ms window kept busy (hold, ramp)")
    p.add_argument("--on", type=float, default=2.0, help="busy seconds per period (pulse)")
    p.add_argument("--every", type=float, default=12.0, help="period in seconds (pulse)")
    a = p.parse_args()
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    start = time.monotonic()
    last_print = -1
    while (t := time.monotonic() - start) < a.until:
        duty = duty_at(a.mode, t, a)
        if int(t) != last_print:
            last_print = int(t)
            print(f"t={t:.0f} duty={duty:.3f}", flush=True)
        busy_until = time.monotonic() + duty * WINDOW_S
        while time.monotonic() < busy_until:
            for _ in range(4):
                x = (x @ x).clamp_(-1, 1)
            torch.cuda.synchronize()
        rest = WINDOW_S * (1 - duty)
        if rest > 0:
            time.sleep(rest)


if __name__ == "__main__":
    main()
