"""Where a qwen3-8b-shape step and its compile spend their time, one component at a time, on one GPU.

    python3 bench/gpu_probe.py --out $OUT --part target          # target forward: eager vs compiled per layer
    python3 bench/gpu_probe.py --out $OUT --part drafter --mode whole   # the trainer's drafter step as is
    python3 bench/gpu_probe.py --out $OUT --part drafter --mode layers
    python3 bench/gpu_probe.py --out $OUT --part attention    # one drafter layer's FlexAttention alone,
        # forward + backward: the default kernel configs, a few backward tiles, then inductor's autotuning
    python3 bench/gpu_probe.py --out $OUT --part optimizer    # the optimizer step alone: as today, AdamW
        # alone, the clipping folded into the fused AdamW, and autocast's bf16 weight copies (~1 min)

Each part prints (and appends to OUT/probe.jsonl as it goes) the seconds of its first call (compilation
included), the steady milliseconds per step (CUDA-synchronised, median of --steps), the compile phases
from torch._dynamo.utils.compile_times(), and the top CUDA kernels of a short torch.profiler trace.
Model FLOPs per sample come from trainer/flops.py, so each component's share of the step is comparable.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from trainer.config import preset, tap_layers
from trainer.data import build_source
from trainer.flops import flops_per_sample
from trainer.model import build_target
from trainer.replica import build_replica, forward_backward, optimizer_step, seeded_drafter

PEAK = 989e12


def emit(out: Path, **fields) -> None:
    line = json.dumps(fields)
    print(line, flush=True)
    with open(out / "probe.jsonl", "a") as fh:
        fh.write(line + "\n")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def top_kernels(fn, steps: int = 3, rows: int = 18) -> list[tuple[str, float]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for event in prof.key_averages():
        cuda_us = getattr(event, "device_time_total", 0.0) or getattr(event, "cuda_time_total", 0.0)
        if event.device_type == torch.autograd.DeviceType.CUDA and cuda_us:
            totals[event.key[:90]] = totals.get(event.key[:90], 0.0) + cuda_us / 1e3 / steps
    return sorted(totals.items(), key=lambda kv: -kv[1])[:rows]


def compile_phases() -> dict[str, float]:
    try:
        table = torch._dynamo.utils.compile_times(repr="csv")
        names, values = table
        return {name: round(float(str(v).split(",")[0]), 2) for name, v in zip(names, values)}
    except Exception as exc:  # noqa: BLE001 - diagnostics only
        return {"error": str(exc)}


def probe_target(args, cfg, out: Path) -> None:
    device = "cuda:0"
    target = build_target(cfg, device).to(torch.bfloat16)
    tokens, _ = build_source(cfg).batch(0, 0)
    tokens = tokens.to(device)
    flops = flops_per_sample(cfg)["target"] * cfg.data.batch
    eager = timed(lambda: target.features(tokens), args.steps)
    ms = statistics.median(eager[2:])
    emit(out, part="target", mode="eager", ms=round(ms, 2), mfu=round(flops / (ms / 1e3) / PEAK, 3))
    emit(out, part="target", mode="eager", kernels=top_kernels(lambda: target.features(tokens)))
    for layer in target.layers:
        layer.compile(dynamic=False)
    start = time.perf_counter()
    target.features(tokens)
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    compiled = timed(lambda: target.features(tokens), args.steps)
    ms = statistics.median(compiled[2:])
    emit(out, part="target", mode="layers-compiled", first_s=round(first, 1), ms=round(ms, 2),
         mfu=round(flops / (ms / 1e3) / PEAK, 3), phases=compile_phases())
    emit(out, part="target", mode="layers-compiled", kernels=top_kernels(lambda: target.features(tokens)))


def probe_drafter(args, cfg, out: Path) -> None:
    device = "cuda:0"
    cfg.run.compile = args.strategy
    cfg.drafter.compile_scope = args.mode
    target = build_target(cfg, device).to(torch.bfloat16)
    tokens, anchors = build_source(cfg).batch(0, 0)
    tokens, anchors = tokens.to(device), anchors.to(device)
    features = target.features(tokens)
    replica = build_replica(cfg, 0, device, seeded_drafter(cfg, device), target.embed, target.lm_head)

    def step() -> None:
        forward_backward(cfg, replica, tokens, features, anchors)
        optimizer_step(cfg, replica)

    start = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    emit(out, part="drafter", mode=args.mode, strategy=args.strategy, first_s=round(first, 1),
         phases=compile_phases())
    times = timed(step, args.steps)
    ms = statistics.median(times[3:])
    flops = (flops_per_sample(cfg)["drafter"] + flops_per_sample(cfg)["head"]) * cfg.data.batch
    emit(out, part="drafter", mode=args.mode, strategy=args.strategy, ms=round(ms, 2),
         mfu=round(flops / (ms / 1e3) / PEAK, 3), spread_ms=[round(min(times[3:]), 1), round(max(times[3:]), 1)],
         peak_gb=round(torch.cuda.max_memory_allocated() / 1e9, 1))
    emit(out, part="drafter", mode=args.mode, strategy=args.strategy, kernels=top_kernels(step, rows=args.rows))


def probe_region(args, cfg, out: Path) -> None:
    """Compile one region alone (forward + backward, bf16 autocast): a drafter layer with its FlexAttention
    mask, or the head loss; first call = its compile."""
    from trainer.model import BlockLayout, Drafter, FlexMaskBuilder, HeadLoss

    device, b, seq = "cuda:0", cfg.data.batch, cfg.data.seq_len
    hidden, block, anchors_n = cfg.target.hidden, cfg.drafter.block_size, cfg.drafter.anchors
    torch.manual_seed(0)
    _, anchors = build_source(cfg).batch(0, 0)
    layout = BlockLayout(anchors.to(device), block, seq)
    if args.part == "layer":
        with torch.device(device):
            drafter = Drafter(cfg.target, cfg.drafter)
        layer = drafter.layers[0]
        mask = FlexMaskBuilder()(layout)
        x = torch.randn(b, anchors_n * block, hidden, device=device, requires_grad=True)
        context = torch.randn(b, seq, hidden, device=device)
        block_pos = layout.positions()
        ctx_pos = torch.arange(seq, device=device).expand(b, -1)
        rope_q, rope_kv = drafter.rotary(block_pos), drafter.rotary(torch.cat((ctx_pos, block_pos), dim=1))
        layer.compile(dynamic=False, options={"triton.cudagraphs": False})

        def call() -> None:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out_ = layer(x, context, rope_q, rope_kv, mask)
            out_.float().pow(2).mean().backward()
    else:
        head = torch.nn.Linear(hidden, cfg.target.vocab_size, bias=False, device=device, dtype=torch.bfloat16)
        loss_fn = HeadLoss(head, cfg.drafter.loss_chunk)
        rows = b * anchors_n * (block - 1)
        predicted = torch.randn(rows, hidden, device=device, requires_grad=True)
        labels = torch.randint(0, cfg.target.vocab_size, (rows,), device=device)
        weights = torch.full((rows,), 1.0 / rows, device=device)
        loss_fn.compile(dynamic=False, options={"triton.cudagraphs": False})

        def call() -> None:
            loss, _ = loss_fn(predicted, labels, weights)
            loss.backward()

    start = time.perf_counter()
    call()
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    ms = statistics.median(timed(call, args.steps)[2:])
    emit(out, part=args.part, first_s=round(first, 1), ms=round(ms, 2), phases=compile_phases())
    emit(out, part=args.part, kernels=top_kernels(call))


def probe_attention(args, cfg, out: Path) -> None:
    """The drafter's FlexAttention alone at its real shapes (queries A*B, keys T+A*B, GQA), forward +
    backward, compiled on its own: the default configs, hand-picked backward tiles, then max_autotune."""
    import torch._inductor.config as inductor_config
    from torch.nn.attention.flex_attention import flex_attention as flex

    from trainer.model import BlockLayout, FlexMaskBuilder

    device, b, t = "cuda:0", cfg.data.batch, cfg.target
    head_dim, queries = t.hidden // t.heads, cfg.drafter.anchors * cfg.drafter.block_size
    _, anchors = build_source(cfg).batch(0, 0)
    layout = BlockLayout(anchors.to(device), cfg.drafter.block_size, cfg.data.seq_len)
    mask = FlexMaskBuilder()(layout)
    torch.manual_seed(0)
    q = torch.randn(b, t.heads, queries, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, t.kv_heads, cfg.data.seq_len + queries, head_dim, device=device, dtype=torch.bfloat16,
                        requires_grad=True) for _ in range(2))
    grad = torch.randn_like(q)
    block = cfg.drafter.block_size
    pairs = queries * ((cfg.data.seq_len - block) / 2 + block) * b
    fwd_flops = 4 * pairs * t.hidden  # QK^T and PV over the visible pairs, all heads (trainer/flops.py)
    variants: list[tuple[str, dict, bool]] = [("default", {}, False)]
    for m1, n1, m2, n2, stages, warps in ((64, 128, 128, 64, 3, 8), (64, 64, 64, 64, 3, 4),
                                         (32, 128, 128, 32, 3, 4), (64, 128, 128, 64, 2, 8),
                                         (128, 128, 128, 128, 2, 8)):
        variants.append((f"bwd {m1}/{n1}/{m2}/{n2} s{stages} w{warps}",
                         {"bwd_BLOCK_M1": m1, "bwd_BLOCK_N1": n1, "bwd_BLOCK_M2": m2, "bwd_BLOCK_N2": n2,
                          "bwd_num_stages": stages, "bwd_num_warps": warps}, False))
    variants.append(("USE_TMA", {"USE_TMA": True}, False))
    variants.append(("max_autotune", {}, True))
    for name, options, autotune in variants:
        torch._dynamo.reset()
        inductor_config.max_autotune = autotune
        compiled = torch.compile(lambda q_, k_, v_, o=options: flex(q_, k_, v_, block_mask=mask, enable_gqa=True,
                                                                     kernel_options=o or None), dynamic=False)

        def fwd(fn=compiled):
            return fn(q, k, v)

        def fwd_bwd(fn=compiled) -> None:
            fn(q, k, v).backward(grad)

        try:
            start = time.perf_counter()
            fwd_bwd()
            torch.cuda.synchronize()
            first = time.perf_counter() - start
            with torch.no_grad():
                fwd_ms = statistics.median(timed(fwd, args.steps)[2:])
            both_ms = statistics.median(timed(fwd_bwd, args.steps)[2:])
        except Exception as exc:  # noqa: BLE001 - a tile the kernel refuses is a result, not a failure
            emit(out, part="attention", variant=name, error=f"{type(exc).__name__}: {str(exc)[:200]}")
            continue
        bwd_ms = both_ms - fwd_ms
        emit(out, part="attention", variant=name, first_s=round(first, 1), fwd_ms=round(fwd_ms, 3),
             bwd_ms=round(bwd_ms, 3), fwd_tflops=round(fwd_flops / fwd_ms / 1e9, 1),
             bwd_tflops=round(2.5 * fwd_flops / bwd_ms / 1e9, 1))
    inductor_config.max_autotune = False


def probe_optimizer(args, cfg, out: Path) -> None:
    """The drafter's optimizer step alone on its 1.05 B fp32 parameters with random gradients: as the trainer
    does it (clip_grad_norm_, then fused AdamW), AdamW alone, the clipping folded into the fused kernel (the
    norm, then AdamW dividing the gradients by max(norm / clip, 1) through `grad_scale`), and the bf16 copy
    of every weight that autocast makes each forward. Milliseconds per step, median of --steps."""
    from trainer.replica import build_optimizer

    device = "cuda:0" if torch.cuda.is_available() else "cpu"  # cpu: a dry run of the script (tiny-cpu)
    drafter = seeded_drafter(cfg, device)
    params = [p for p in drafter.parameters() if p.requires_grad]
    for param in params:
        param.grad = torch.randn_like(param) * 1e-3
    optimizer, _ = build_optimizer(cfg, drafter, device)
    clip = cfg.optim.grad_clip or 1.0
    emit(out, part="optimizer", params=sum(p.numel() for p in params), clip=clip)

    def today() -> None:
        torch.nn.utils.clip_grad_norm_(params, clip)
        optimizer.step()

    def folded() -> None:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        optimizer.grad_scale = torch.clamp(norm / clip, min=1.0).float()
        optimizer.step()
        del optimizer.grad_scale

    variants = {"clip + fused AdamW (today)": today, "fused AdamW alone": optimizer.step,
                "clip_grad_norm_ alone": lambda: torch.nn.utils.clip_grad_norm_(params, clip),
                **({"norm folded into fused AdamW (grad_scale)": folded} if device != "cpu" else {}),
                "bf16 copy of every weight": lambda: [p.detach().to(torch.bfloat16) for p in params]}
    for name, fn in variants.items():
        ms = statistics.median(timed(fn, args.steps)[3:])
        emit(out, part="optimizer", variant=name, ms=round(ms, 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--part", choices=("target", "drafter", "layer", "head", "attention", "optimizer"),
                        required=True)
    parser.add_argument("--mode", default="whole", help="drafter: whole | layers (drafter.compile_scope)")
    parser.add_argument("--strategy", default="nographs")
    parser.add_argument("--preset", default="qwen3-8b-shape")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--rows", type=int, default=18, help="kernels listed in the drafter profile")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cfg = preset(args.preset)
    emit(args.out, part=args.part, preset=args.preset, taps=tap_layers(cfg.target.layers, cfg.drafter.taps),
         torch=torch.__version__, gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
    parts = {"target": probe_target, "drafter": probe_drafter, "layer": probe_region, "head": probe_region,
             "attention": probe_attention, "optimizer": probe_optimizer}
    parts[args.part](args, cfg, args.out)


if __name__ == "__main__":
    main()
