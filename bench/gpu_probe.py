"""Where a qwen3-8b-shape step and its compile spend their time, one component at a time, on one GPU.

    python3 bench/gpu_probe.py --out $OUT --part target          # target forward: eager vs compiled per layer
    python3 bench/gpu_probe.py --out $OUT --part drafter --mode whole   # the trainer's drafter step as is
    python3 bench/gpu_probe.py --out $OUT --part drafter --mode layers
    python3 bench/gpu_probe.py --out $OUT --part attention    # one drafter layer's FlexAttention alone,
        # forward + backward: the default kernel configs, a few backward tiles, then inductor's autotuning
    python3 bench/gpu_probe.py --out $OUT --part flash        # the same attention through FlexAttention's
        # Triton kernels and its FlashAttention-4 ones (BACKEND=FLASH; needs flash-attn-4: bench/gpu_flash.sh)
    python3 bench/gpu_probe.py --out $OUT --part ceiling      # every matmul of one step alone at its real
        # shape, plus the drafter's attention: the floor of the step's time, so a ceiling for its MFU (~1 min)
    python3 bench/gpu_probe.py --out $OUT --part optimizer    # the optimizer step alone: as the trainer did it
        # before (clip_grad_norm_, then fused AdamW), AdamW alone, the trainer's (the clipping folded into the fused
        # AdamW), and autocast's bf16 weight copies (~1 min)
    python3 bench/gpu_probe.py --out $OUT --part mask         # the BlockMask of one step at the preset's
        # shapes: create_block_mask (the trainer before) against the trainer's FlexMaskBuilder, same tables
    python3 bench/gpu_probe.py --out $OUT --part drafter --mode layers --before   # the drafter step as the
        # trainer takes it, and with the BlockMask and the clipping as they were before (issue 16's step
        # overheads), alternated in one process after one compile

Every part runs on CPU too (a dry run of the script: `--preset tiny-cpu`, same lines; CPU times are not
GPU figures).

Kernel-structure A/Bs (issue 16), each in ONE process at the real shapes (batch 2), bf16, compiled as the
trainer compiles, 8 timed steps; all of them on one H200 (~4-6 min, each part cold in its own process):
    OUT=$OUT bash bench/gpu_probe.sh variants
    python3 bench/gpu_probe.py --out $OUT --part target-variants   # one target layer, then the whole forward
        # (34 layers): today | q/k/v and gate/up fused | + rope without the fp32 round trip | SDPA forced to
        # flash | cuDNN | cuDNN with k/v repeated | mode=max-autotune-no-cudagraphs (its compile seconds)
    python3 bench/gpu_probe.py --out $OUT --part head-variants     # HeadLoss at loss_chunk 1024..8192
    python3 bench/gpu_probe.py --out $OUT --part drafter-variants  # one drafter layer fwd+bwd: today | k/v and
        # gate/up fused (fp32 parameters concatenated inside the compiled region) | q/k/v fused on the block
    python3 bench/gpu_probe.py --out $OUT --part attention-layout  # q/k rotated before their heads move
        # forward (FlexAttention's q/k/v, output and output gradient all (b, L, h, d) views, no transposing
        # copies) vs today: one drafter layer fwd+bwd, then one target layer forward (~1 min)
--variants NAME,... picks variants; a CPU dry run: --preset tiny-cpu (the same lines, CUDA-only variants
as error lines). Each variant line carries rel_err against `today` (0.004 is one bf16 rounding).

Each part prints (and appends to OUT/probe.jsonl as it goes) the seconds of its first call (compilation
included), the steady milliseconds per step (CUDA-synchronised, median of --steps), the compile phases
from torch._dynamo.utils.compile_times(), and the top CUDA kernels of a short torch.profiler trace.
Model FLOPs per sample come from trainer/flops.py, so each component's share of the step is comparable.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import time
from pathlib import Path

import torch

from trainer.compile import COMPILE_KWARGS
from trainer.config import preset, tap_layers
from trainer.data import build_source
from trainer.flops import flops_per_sample
from trainer.model import Rotary, build_target, model_dtype
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
    device = probe_device()
    cfg.run.compile = args.strategy
    cfg.drafter.compile_scope = args.mode
    target = build_target(cfg, device).to(model_dtype(cfg))
    tokens, anchors = build_source(cfg).batch(0, 0)
    tokens, anchors = tokens.to(device), anchors.to(device)
    features = target.features(tokens)
    replica = build_replica(cfg, 0, device, seeded_drafter(cfg, device), target.embed, target.lm_head)

    def step() -> None:
        forward_backward(cfg, replica, tokens, features, anchors)
        optimizer_step(cfg, replica)

    start = time.perf_counter()
    step()
    sync()
    first = time.perf_counter() - start
    emit(out, part="drafter", mode=args.mode, strategy=args.strategy, first_s=round(first, 1),
         phases=compile_phases())
    flops = (flops_per_sample(cfg)["drafter"] + flops_per_sample(cfg)["head"]) * cfg.data.batch
    variants = {"trainer": step}
    if args.before:
        variants["before"] = before_step(cfg, replica, (tokens, features, anchors))
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(3 if args.before else 1):  # alternated, so a drift of the machine hits both alike
        for name, fn in variants.items():
            times[name] += timed(fn, args.steps)[3:]
    for name, runs in times.items():
        ms = statistics.median(runs)
        emit(out, part="drafter", mode=args.mode, strategy=args.strategy, variant=name, ms=round(ms, 2),
             mfu=round(flops / (ms / 1e3) / PEAK, 3), spread_ms=[round(min(runs), 1), round(max(runs), 1)],
             peak_gb=round(torch.cuda.max_memory_allocated() / 1e9, 1) if device != "cpu" else None)
    if device != "cpu":
        emit(out, part="drafter", mode=args.mode, strategy=args.strategy, kernels=top_kernels(step, rows=args.rows))


def before_step(cfg, replica, inputs: tuple[torch.Tensor, ...]):
    """The same step with the two overheads issue 16 took out put back: the BlockMask from create_block_mask
    over the b x Q x KV mask (the builder's own mask_mod and anchor buffer, so the compiled layers see the
    same function and nothing recompiles) and the clipping as a separate clip_grad_norm_ pass."""
    from torch.nn.attention.flex_attention import create_block_mask

    objective = replica.compiled.module
    builder = objective.build_mask

    def build_with_create_block_mask(layout):
        query_anchor = layout.query_anchor()  # (b, A*B)
        builder.query_anchor.copy_(query_anchor)
        b, num_queries = query_anchor.shape
        return create_block_mask(builder.mask_mod, b, None, num_queries, layout.context_len + num_queries,
                                 device=query_anchor.device)

    def clip_then_step() -> None:
        torch.nn.utils.clip_grad_norm_(replica.drafter.parameters(), cfg.optim.grad_clip)
        replica.optimizer.step()
        replica.scheduler.step()
        replica.optimizer.zero_grad(set_to_none=True)

    def before() -> None:
        if cfg.drafter.compile_scope == "layers" and objective.use_flex:
            objective.build_mask = build_with_create_block_mask
        try:
            forward_backward(cfg, replica, *inputs)
            clip_then_step()
        finally:
            objective.build_mask = builder

    return before


def drafter_layer_inputs(cfg, device: str):
    """A seeded drafter and the inputs of one of its layers at the preset's shapes, as the trainer feeds them:
    (x, context, rope_q, rope_kv, mask), the block stream and the fused context in bf16, both needing their
    gradients; the FlexAttention BlockMask on CUDA, the dense SDPA mask on the CPU."""
    from trainer.model import BlockLayout, Drafter, FlexMaskBuilder, dense_mask

    b, seq, hidden = cfg.data.batch, cfg.data.seq_len, cfg.target.hidden
    _, anchors = build_source(cfg).batch(0, 0)
    layout = BlockLayout(anchors.to(device), cfg.drafter.block_size, seq)
    torch.manual_seed(0)
    with torch.device(device):
        drafter = Drafter(cfg.target, cfg.drafter)
    mask = FlexMaskBuilder()(layout) if device != "cpu" else dense_mask(layout)
    x = torch.randn(b, cfg.drafter.anchors * cfg.drafter.block_size, hidden, device=device, dtype=torch.bfloat16,
                    requires_grad=True)  # (b, A*B, H)
    context = torch.randn(b, seq, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)  # (b, T, H)
    block_pos = layout.positions()  # (b, A*B)
    ctx_pos = torch.arange(seq, device=device).expand(b, -1)  # (b, T)
    rope_q, rope_kv = drafter.rotary(block_pos), drafter.rotary(torch.cat((ctx_pos, block_pos), dim=1))
    return drafter, (x, context, rope_q, rope_kv, mask)


def head_inputs(cfg, device: str):
    """The frozen bf16 head and the head loss's inputs at the preset's shapes: (head, predicted (N, H) fp32
    needing its gradient, labels (N,), row weights (N,) summing to 1)."""
    rows = cfg.data.batch * cfg.drafter.anchors * (cfg.drafter.block_size - 1)
    torch.manual_seed(0)
    head = torch.nn.Linear(cfg.target.hidden, cfg.target.vocab_size, bias=False, device=device, dtype=torch.bfloat16)
    torch.nn.init.normal_(head.weight, std=cfg.target.init_std)
    predicted = torch.randn(rows, cfg.target.hidden, device=device, requires_grad=True)
    labels = torch.randint(0, cfg.target.vocab_size, (rows,), device=device)
    weights = torch.rand(rows, device=device)
    return head, predicted, labels, weights / weights.sum()


def probe_region(args, cfg, out: Path) -> None:
    """Compile one region alone (forward + backward, bf16 autocast): a drafter layer with its FlexAttention
    mask, or the head loss; first call = its compile."""
    from trainer.model import HeadLoss

    if args.part == "layer":
        drafter, inputs = drafter_layer_inputs(cfg, "cuda:0")
        layer = drafter.layers[0]
        layer.compile(dynamic=False, options={"triton.cudagraphs": False})

        def call() -> None:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out_ = layer(*inputs)
            out_.float().pow(2).mean().backward()
    else:
        head, predicted, labels, weights = head_inputs(cfg, "cuda:0")
        loss_fn = HeadLoss(head, cfg.drafter.loss_chunk)
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


def attention_inputs(cfg):
    """One drafter layer's attention at the preset's shapes (queries A*B, keys T+A*B, GQA), bf16, seeded:
    (q, k, v, output gradient, the trainer's BlockMask, the counted forward FLOPs of trainer/flops.py)."""
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
    return q, k, v, grad, mask, 4 * pairs * t.hidden  # QK^T and PV over the visible pairs, all heads


def flex_pair(q, k, v, grad, mask, options: dict | None):
    """FlexAttention over (q, k, v) with the BlockMask, compiled on its own with these kernel_options:
    (forward, forward + backward) callables."""
    from torch.nn.attention.flex_attention import flex_attention as flex

    compiled = torch.compile(lambda q_, k_, v_: flex(q_, k_, v_, block_mask=mask, enable_gqa=True,
                                                     kernel_options=options or None), dynamic=False)
    return (lambda: compiled(q, k, v)), (lambda: compiled(q, k, v).backward(grad))


def fwd_bwd_ms(fwd, fwd_bwd, steps: int) -> tuple[float, float]:
    """Steady forward ms and backward ms (forward + backward less forward), medians past two warm steps."""
    with torch.no_grad():
        fwd_ms = statistics.median(timed(fwd, steps)[2:])
    return fwd_ms, statistics.median(timed(fwd_bwd, steps)[2:]) - fwd_ms


def probe_flash(args, cfg, out: Path) -> None:
    """The drafter's attention alone (forward + backward, compiled on its own) through FlexAttention's Triton
    kernels (the trainer's) and its FlashAttention-4 CuTe ones (kernel_options BACKEND=FLASH; needs
    flash-attn-4): cold first call, steady ms, TFLOP/s of counted work, and the output's and gradients' error
    against Triton."""
    q, k, v, grad, mask, fwd_flops = attention_inputs(cfg)
    results: dict[str, list[torch.Tensor]] = {}
    for name, options in (("flex", None), ("flash", {"BACKEND": "FLASH"})):
        torch._dynamo.reset()
        fwd, fwd_bwd = flex_pair(q, k, v, grad, mask, options)
        try:
            start = time.perf_counter()
            for tensor in (q, k, v):
                tensor.grad = None
            output = fwd()
            output.backward(grad)
            torch.cuda.synchronize()
            first = time.perf_counter() - start
            results[name] = [output.detach().float(), *(t.grad.float() for t in (q, k, v))]
            fwd_ms, bwd_ms = fwd_bwd_ms(fwd, fwd_bwd, args.steps)
        except Exception as exc:  # noqa: BLE001 - a backend that cannot run is a result, not a failure
            emit(out, part="flash", variant=name, error=root_cause(exc)[:600])
            continue
        errors = {}
        if name != "flex" and "flex" in results:
            errors = {f"rel_err_{what}": round(rel_err(mine, ref), 5)
                      for what, mine, ref in zip(("out", "dq", "dk", "dv"), results[name], results["flex"])}
        emit(out, part="flash", variant=name, first_s=round(first, 1), fwd_ms=round(fwd_ms, 3),
             bwd_ms=round(bwd_ms, 3), fwd_tflops=round(fwd_flops / fwd_ms / 1e9, 1),
             bwd_tflops=round(2.5 * fwd_flops / bwd_ms / 1e9, 1), **errors, kernels=cuda_kernels(fwd_bwd))


def probe_attention(args, cfg, out: Path) -> None:
    """The drafter's FlexAttention alone at its real shapes (queries A*B, keys T+A*B, GQA), forward +
    backward, compiled on its own: the default configs, hand-picked backward tiles, then max_autotune."""
    import torch._inductor.config as inductor_config

    q, k, v, grad, mask, fwd_flops = attention_inputs(cfg)
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
        fwd, fwd_bwd = flex_pair(q, k, v, grad, mask, options)
        try:
            start = time.perf_counter()
            fwd_bwd()
            torch.cuda.synchronize()
            first = time.perf_counter() - start
            fwd_ms, bwd_ms = fwd_bwd_ms(fwd, fwd_bwd, args.steps)
        except Exception as exc:  # noqa: BLE001 - a tile the kernel refuses is a result, not a failure
            emit(out, part="attention", variant=name, error=f"{type(exc).__name__}: {str(exc)[:200]}")
            continue
        emit(out, part="attention", variant=name, first_s=round(first, 1), fwd_ms=round(fwd_ms, 3),
             bwd_ms=round(bwd_ms, 3), fwd_tflops=round(fwd_flops / fwd_ms / 1e9, 1),
             bwd_tflops=round(2.5 * fwd_flops / bwd_ms / 1e9, 1))
    inductor_config.max_autotune = False


def step_gemms(cfg) -> list[tuple[str, int, int, int, int]]:
    """Every matmul of one training step (cfg.data.batch samples) as (name, M, N, K, count): the target's
    forward up to its last tapped layer, the drafter's forward, input and weight gradients (the fused taps'
    input is the frozen target's: no input gradient), the frozen head's forward and input gradient. A
    linear layer x (M, K) @ W (N, K)^T is timed as F.linear; its input gradient as dY (M, N) @ W (N, K), its
    weight gradient as dY^T (N, M) @ x (M, K)."""
    t, d, b = cfg.target, cfg.drafter, cfg.data.batch
    hidden, kv, inter = t.hidden, t.kv_heads * (t.hidden // t.heads), t.intermediate
    tokens, block = b * cfg.data.seq_len, b * d.anchors * d.block_size
    target_layers = max(tap_layers(t.layers, d.taps)) + 1
    layer = [("q", hidden, hidden, "q"), ("k", kv, hidden, "kv"), ("v", kv, hidden, "kv"), ("o", hidden, hidden, "q"),
             ("gate", inter, hidden, "q"), ("up", inter, hidden, "q"), ("down", hidden, inter, "q")]
    gemms = [(f"target {name} fwd", tokens, n, k, target_layers) for name, n, k, _ in layer]
    gemms.append(("drafter fuse fwd", tokens, hidden, d.taps * hidden, 1))
    gemms.append(("drafter fuse wgrad", hidden, d.taps * hidden, tokens, 1))
    for name, n, k, rows in layer:
        m = block if rows == "q" else tokens + block  # k/v project [context; block]
        gemms += [(f"drafter {name} fwd", m, n, k, d.layers), (f"drafter {name} dgrad", m, k, n, d.layers),
                  (f"drafter {name} wgrad", n, k, m, d.layers)]
    head_rows = b * d.anchors * (d.block_size - 1)
    gemms += [("head fwd", head_rows, t.vocab_size, hidden, 1), ("head dgrad", head_rows, hidden, t.vocab_size, 1)]
    return gemms


def probe_ceiling(args, cfg, out: Path) -> None:
    """What the step's counted work costs at the speed of its own kernels alone: every matmul of one step timed
    in isolation at its real shape (bf16, cuBLAS as torch picks it, no other work on the GPU), plus the
    drafter's FlexAttention (forward + backward, compiled alone) once per layer. Their sum is a floor for the
    step's time, so counted FLOPs / that sum is a ceiling for its MFU: no overlap or scheduling can beat it
    without faster kernels. Also each GEMM's TFLOP/s (which shapes and layouts run below cuBLAS's best)."""
    device, b = ("cuda:0" if torch.cuda.is_available() else "cpu"), cfg.data.batch
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    gemm_ms, gemm_flops, rows = 0.0, 0.0, []
    scale = args.gemm_scale  # the weight's (and the output gradient's) magnitude against N(0, 1) activations
    for name, m, n, k, count in step_gemms(cfg):
        x = torch.randn(m, k, device=device, dtype=dtype)
        if name.endswith("fwd"):
            w = torch.randn(n, k, device=device, dtype=dtype) * scale
            fn = lambda x=x, w=w: torch.nn.functional.linear(x, w)  # noqa: E731
        elif name.endswith("dgrad"):  # dY (m, n') @ W (n', k): here x is dY (m, k=n'), w is W (k, n)
            x, w = x * scale, torch.randn(k, n, device=device, dtype=dtype) * scale
            fn = lambda x=x, w=w: x @ w  # noqa: E731
        else:  # wgrad dY^T @ x: dY (k, m)^T @ x (k, n), the M x N result
            dy = torch.randn(k, m, device=device, dtype=dtype) * scale
            xin = torch.randn(k, n, device=device, dtype=dtype)
            fn = lambda dy=dy, xin=xin: dy.t() @ xin  # noqa: E731
        reps = 5
        ms = statistics.median(timed(lambda fn=fn: [fn() for _ in range(reps)], args.steps)[2:]) / reps
        flops = 2.0 * m * n * k
        gemm_ms += ms * count / b
        gemm_flops += flops * count / b
        rows.append((name, m, n, k, count, round(ms, 3), round(flops / ms / 1e9, 1)))
        del x, fn
        emit(out, part="ceiling", gemm=name, m=m, n=n, k=k, count=count, ms=round(ms, 3),
             tflops=round(flops / ms / 1e9, 1))
    attention_ms = 0.0
    if device != "cpu" and cfg.drafter.layers:
        _, fwd_bwd = flex_pair(*attention_inputs(cfg)[:5], None)
        fwd_bwd()
        attention_ms = statistics.median(timed(fwd_bwd, args.steps)[2:]) * cfg.drafter.layers / b
    counted = flops_per_sample(cfg)["total"]
    floor_ms = gemm_ms + attention_ms
    emit(out, part="ceiling", gemm_scale=scale, per_sample_gemm_ms=round(gemm_ms, 2), gemm_tflops=round(gemm_flops / gemm_ms / 1e9, 1),
         gemm_tflop_per_sample=round(gemm_flops / 1e12, 2), per_sample_attention_ms=round(attention_ms, 2),
         counted_tflop_per_sample=round(counted / 1e12, 2), floor_ms=round(floor_ms, 2),
         mfu_ceiling=round(counted / (floor_ms / 1e3) / PEAK, 4),
         slowest=sorted(rows, key=lambda r: r[6])[:8])


def probe_optimizer(args, cfg, out: Path) -> None:
    """The drafter's optimizer step alone on its fp32 parameters (1.05 B for qwen3-8b-shape) with random
    gradients: as the trainer did it before (clip_grad_norm_, then fused AdamW), AdamW alone, clip_grad_norm_
    alone, the trainer's (replica.clipped_step: the norm, then the fused AdamW dividing the gradients by
    max(norm / clip, 1) as it reads them, through `grad_scale`), and the bf16 copy of every weight that
    autocast makes each forward. Milliseconds per step, median of --steps."""
    from trainer.replica import build_optimizer, clipped_step

    device = probe_device()
    drafter = seeded_drafter(cfg, device)
    params = [p for p in drafter.parameters() if p.requires_grad]
    for param in params:
        param.grad = torch.randn_like(param) * 1e-3
    optimizer, _ = build_optimizer(cfg, drafter)
    clip = cfg.optim.grad_clip or 1.0
    emit(out, part="optimizer", params=sum(p.numel() for p in params), clip=clip)

    def before() -> None:
        torch.nn.utils.clip_grad_norm_(params, clip)
        optimizer.step()

    variants = {"clip + fused AdamW (before)": before, "fused AdamW alone": optimizer.step,
                "clip_grad_norm_ alone": lambda: torch.nn.utils.clip_grad_norm_(params, clip),
                "norm folded into fused AdamW (trainer: clipped_step)": lambda: clipped_step(optimizer, params, clip),
                "bf16 copy of every weight": lambda: [p.detach().to(torch.bfloat16) for p in params]}
    for name, fn in variants.items():
        ms = statistics.median(timed(fn, args.steps)[3:])
        emit(out, part="optimizer", variant=name, ms=round(ms, 2))


def probe_mask(args, cfg, out: Path) -> None:
    """The BlockMask of one step at the preset's shapes (b x A*B queries x T+A*B keys), eager as scope
    `layers` builds it: create_block_mask over the whole mask (the trainer before) against the trainer's
    FlexMaskBuilder (tile tables counted from the anchors). Both tables are compared; ms = median of --steps."""
    from torch.nn.attention.flex_attention import create_block_mask

    from trainer.model import BlockLayout, FlexMaskBuilder

    device = probe_device()
    _, anchors = build_source(cfg).batch(0, 0)
    layout = BlockLayout(anchors.to(device), cfg.drafter.block_size, cfg.data.seq_len)
    builder = FlexMaskBuilder()
    mine = builder(layout)
    query_anchor = layout.query_anchor()  # (b, A*B)
    b, num_queries = query_anchor.shape

    def before():
        builder.query_anchor.copy_(query_anchor)
        return create_block_mask(builder.mask_mod, b, None, num_queries, layout.context_len + num_queries,
                                 device=query_anchor.device)

    same = all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
               for x, y in zip(mine.as_tuple(), before().as_tuple()) if not callable(x))
    emit(out, part="mask", queries=num_queries, keys=layout.context_len + num_queries, batch=b, same_tables=same,
         sparsity=round(mine.sparsity(), 1))
    variants = {"create_block_mask (before)": before, "FlexMaskBuilder (trainer)": lambda: builder(layout)}
    for name, fn in variants.items():
        ms = statistics.median(timed(fn, args.steps)[3:])
        emit(out, part="mask", variant=name, ms=round(ms, 3))


# ------------------------------------------------------------------ kernel-structure A/B variants (issue 16)


def probe_device() -> str:
    """cuda:0, or the CPU for a dry run of the script (--preset tiny-cpu)."""
    return "cuda:0" if torch.cuda.is_available() else "cpu"


def first_and_steady(fn, steps: int) -> tuple[float, float, list[float]]:
    """Seconds of the first call (its compile included), then the median ms of `steps` timed calls (the first
    two of them dropped as warm-up) and the spread of the kept ones."""
    sync()
    start = time.perf_counter()
    fn()
    sync()
    first = time.perf_counter() - start
    times = timed(fn, steps + 2)[2:]
    return first, statistics.median(times), [round(min(times), 2), round(max(times), 2)]


def chosen(args, variants: dict) -> list[str]:
    """The variants --variants names (all by default), or exit naming the ones this part has."""
    unknown = [name for name in args.variants or () if name not in variants]
    if unknown:
        raise SystemExit(f"--variants: {','.join(unknown)} unknown to --part {args.part}; expected some of "
                         f"{','.join(variants)}")
    return args.variants or list(variants)


def rel_err(value: torch.Tensor, reference: torch.Tensor) -> float:
    """max |value - reference| / max |reference|: 0.4% is one bf16 rounding of the largest element."""
    value, reference = value.detach().float(), reference.detach().float()
    return round(float((value - reference).abs().max() / reference.abs().max().clamp_min(1e-30)), 5)


def root_cause(exc: BaseException) -> str:
    """The innermost error of a compile failure (dynamo wraps the backend's own message in its explanation)."""
    while (exc.__cause__ or exc.__context__) is not None:
        exc = exc.__cause__ or exc.__context__
    text = str(exc).strip()
    if "got " in text:  # "Dynamo failed to run FX node with fake tensors: call_function ...: got RuntimeError(...)"
        text = text[text.index("got ") + 4:].split("\n")[0]
    return f"{type(exc).__name__}: {text[:300]}"


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_gb() -> float:
    return round(torch.cuda.max_memory_allocated() / 1e9, 1) if torch.cuda.is_available() else 0.0


def cuda_kernels(fn, rows: int = 6) -> list[tuple[str, float]]:
    """The top CUDA kernels of `fn` (names say which SDPA backend ran); none on the CPU."""
    if not torch.cuda.is_available():
        return []
    return [(name, round(ms, 3)) for name, ms in top_kernels(fn, steps=2, rows=rows)]


def apply_rope_bf16(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rope without its fp32 round trip: cos/sin rounded to x's dtype, the rotation in that dtype."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]  # (b, 1, L, d/2)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)  # (b, h, L, d/2) each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # (b, h, L, d)


class FusedTargetLayer(torch.nn.Module):
    """A TargetLayer's maths with q/k/v as one matmul and gate/up as one: its weights concatenated once (the
    target is frozen); norms, o and down shared with the layer it is made from. `rope` and `repeat_kv`
    (k/v repeated to every query head instead of SDPA's enable_gqa) are the other levers probed."""

    def __init__(self, layer, rope=None, repeat_kv: bool = False) -> None:
        super().__init__()
        from trainer.model import apply_rope

        proj, mlp = layer.proj, layer.mlp
        self.attn_norm, self.mlp_norm, self.q_norm, self.k_norm = layer.attn_norm, layer.mlp_norm, proj.q_norm, proj.k_norm
        self.o, self.down = proj.o, mlp.down
        self.heads, self.kv_heads, self.head_dim = proj.heads, proj.kv_heads, proj.head_dim
        self.qkv = torch.nn.Parameter(torch.cat((proj.q.weight, proj.k.weight, proj.v.weight)), requires_grad=False)
        self.gate_up = torch.nn.Parameter(torch.cat((mlp.gate.weight, mlp.up.weight)), requires_grad=False)
        self.split = (proj.q.out_features, proj.k.out_features, proj.v.out_features)
        self.rope = rope or apply_rope
        self.repeat_kv = repeat_kv

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, length, _ = x.shape
        q, k, v = torch.nn.functional.linear(self.attn_norm(x), self.qkv).split(self.split, dim=-1)  # (b, T, *)
        q = self.q_norm(q.view(b, length, self.heads, self.head_dim)).transpose(1, 2)  # (b, h, T, d)
        k = self.k_norm(k.view(b, length, self.kv_heads, self.head_dim)).transpose(1, 2)  # (b, kv, T, d)
        v = v.view(b, length, self.kv_heads, self.head_dim).transpose(1, 2)  # (b, kv, T, d)
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        if self.repeat_kv:
            groups = self.heads // self.kv_heads
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # (b, h, T, d)
        attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                enable_gqa=not self.repeat_kv)  # (b, h, T, d)
        x = x + self.o(attn.transpose(1, 2).reshape(b, length, -1))  # (b, T, H)
        gate, up = torch.nn.functional.linear(self.mlp_norm(x), self.gate_up).chunk(2, dim=-1)  # (b, T, I) each
        return x + self.down(torch.nn.functional.silu(gate) * up)


@contextlib.contextmanager
def sdpa_backend(name: str):
    """A context forcing one SDPA backend (flash | cudnn | efficient), or none for the default choice. It is
    entered around the first (compiling) call too: the backend is chosen when the graph is traced, and the
    caches that would hand back a graph compiled under another backend are off meanwhile (their keys do not
    hold the backend: in the first H200 call, at a84b243, forced flash got the default's graph, cuDNN)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not name:
        yield
        return
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    with sdpa_kernel(backends[name]), inductor_config.patch(fx_graph_cache=False), \
            functorch_config.patch(enable_autograd_cache=False):
        yield


# name -> (fused q/k/v + gate/up, rope without the fp32 round trip, SDPA backend forced, k/v repeated, compile)
TARGET_VARIANTS: dict[str, tuple[bool, bool, str, bool, dict]] = {
    "today": (False, False, "", False, COMPILE_KWARGS["nographs"]),
    "fused": (True, False, "", False, COMPILE_KWARGS["nographs"]),
    "rope-bf16": (True, True, "", False, COMPILE_KWARGS["nographs"]),
    "flash": (False, False, "flash", False, COMPILE_KWARGS["nographs"]),
    "cudnn": (False, False, "cudnn", False, COMPILE_KWARGS["nographs"]),
    "cudnn-repeat-kv": (True, False, "cudnn", True, COMPILE_KWARGS["nographs"]),
    "max-autotune": (False, False, "", False, {"mode": "max-autotune-no-cudagraphs", "dynamic": False}),
    "fused-max-autotune": (True, False, "", False, {"mode": "max-autotune-no-cudagraphs", "dynamic": False}),
}


def probe_target_variants(args, cfg, out: Path) -> None:
    """One target layer, then the whole forward up to the last tap, per variant: bf16 weights, no grad, each
    compiled as compile_target compiles (or as the variant says), in this one process. rope-bf16 is applied
    on top of `fused` (compare it with `fused`); cudnn-repeat-kv too, in case cuDNN refuses enable_gqa.
    rel_err is against `today`'s output (layer) or features (forward)."""
    device, b, seq = probe_device(), cfg.data.batch, cfg.data.seq_len
    target = build_target(cfg, device).to(torch.bfloat16)
    tokens, _ = build_source(cfg).batch(0, 0)
    tokens = tokens.to(device)
    layers = list(target.layers)
    layer_flops = flops_per_sample(cfg)["target"] / len(layers) * b
    torch.manual_seed(0)
    x = torch.randn(b, seq, cfg.target.hidden, device=device, dtype=torch.bfloat16)
    cos, sin = target.rotary(torch.arange(seq, device=device))  # (T, d/2) each
    reference: dict[str, torch.Tensor] = {}
    for name in chosen(args, TARGET_VARIANTS):
        fused, rope16, backend, repeat_kv, kwargs = TARGET_VARIANTS[name]
        torch._dynamo.reset()
        variant = [FusedTargetLayer(layer, apply_rope_bf16 if rope16 else None, repeat_kv) if fused
                   else copy.copy(layer) for layer in layers]  # shallow copies: each its own compiled wrapper
        variant[0].compile(**kwargs)
        try:
            with torch.no_grad(), sdpa_backend(backend):
                first, ms, spread = first_and_steady(lambda: variant[0](x, cos, sin), args.steps)
                out_ = variant[0](x, cos, sin)
                kernels = cuda_kernels(lambda: variant[0](x, cos, sin))
        except Exception as exc:  # noqa: BLE001 - a backend that refuses these shapes is a result
            emit(out, part="target-variants", variant=name, scope="layer", error=root_cause(exc))
            continue
        reference.setdefault("layer", out_)
        emit(out, part="target-variants", variant=name, scope="layer", first_s=round(first, 1), ms=round(ms, 3),
             spread_ms=spread, tflops=round(layer_flops / ms / 1e9, 1), mfu=round(layer_flops / (ms / 1e3) / PEAK, 3),
             rel_err=rel_err(out_, reference["layer"]), kernels=kernels)
        if not args.whole:
            continue
        for layer in variant[1:]:
            layer.compile(**kwargs)  # the same code: the first layer's graph serves them all
        target.layers = torch.nn.ModuleList(variant)
        with torch.no_grad(), sdpa_backend(backend):
            first, ms, spread = first_and_steady(lambda: target.features(tokens), args.steps)
            features = target.features(tokens)
        target.layers = torch.nn.ModuleList(layers)
        reference.setdefault("forward", features)
        emit(out, part="target-variants", variant=name, scope=f"forward-{len(layers)}", first_s=round(first, 1),
             ms=round(ms, 2), spread_ms=spread, mfu=round(layer_flops * len(layers) / (ms / 1e3) / PEAK, 3),
             rel_err=rel_err(features, reference["forward"]), peak_gb=peak_gb())
        del variant, features


def probe_head_variants(args, cfg, out: Path) -> None:
    """The head loss (HeadLoss, compiled as compile scope `layers` compiles it under nographs) at each
    drafter.loss_chunk of --chunks, forward + backward, in one process; rel_err of the loss and of the input
    gradient against the first chunk size."""
    from trainer.model import HeadLoss

    device = probe_device()
    flops = flops_per_sample(cfg)["head"] * cfg.data.batch
    head, predicted, labels, weights = head_inputs(cfg, device)
    reference = None
    for chunk in args.chunks:
        torch._dynamo.reset()
        loss_fn = HeadLoss(head, chunk)
        loss_fn.compile(**COMPILE_KWARGS["nographs"])

        def call(fn=loss_fn) -> torch.Tensor:
            predicted.grad = None
            loss, _ = fn(predicted, labels, weights)
            loss.backward()
            return loss

        reset_peak()
        try:
            first, ms, spread = first_and_steady(call, args.steps)
        except torch.OutOfMemoryError as exc:
            emit(out, part="head-variants", loss_chunk=chunk, error=root_cause(exc))
            continue
        loss = call()
        reference = reference or (loss.detach(), predicted.grad.detach().clone())
        emit(out, part="head-variants", loss_chunk=chunk, rows=len(labels), first_s=round(first, 1), ms=round(ms, 2),
             spread_ms=spread, tflops=round(flops / ms / 1e9, 1), mfu=round(flops / (ms / 1e3) / PEAK, 3),
             peak_gb=peak_gb(), loss_rel_err=rel_err(loss, reference[0]),
             grad_rel_err=rel_err(predicted.grad, reference[1]))


class FusedDrafterLayer(torch.nn.Module):
    """A DrafterLayer's maths with k/v as one matmul and gate/up as one, its own fp32 parameters concatenated
    inside the compiled forward (the parameters, their names and the checkpoints stay as they are).
    `qkv_block`: q/k/v of the block tokens as one matmul and k/v of the context as another, instead of k/v
    over [context; block]."""

    def __init__(self, layer, qkv_block: bool = False) -> None:
        super().__init__()
        self.layer, self.qkv_block = layer, qkv_block

    def forward(self, x, context, rope_q, rope_kv, mask) -> torch.Tensor:
        from trainer.model import apply_rope, flex_attention

        linear, layer = torch.nn.functional.linear, self.layer
        proj, mlp = layer.proj, layer.mlp
        b, queries, _ = x.shape
        kv_weight = torch.cat((proj.k.weight, proj.v.weight))  # (2*kv*d, H)
        h = layer.attn_norm(x)  # (b, A*B, H)
        if self.qkv_block:
            q, k_block, v_block = linear(h, torch.cat((proj.q.weight, kv_weight))).split(
                (proj.q.out_features, proj.k.out_features, proj.v.out_features), dim=-1)
            k_ctx, v_ctx = linear(context, kv_weight).chunk(2, dim=-1)  # (b, T, kv*d) each
            k, v = torch.cat((k_ctx, k_block), dim=1), torch.cat((v_ctx, v_block), dim=1)  # (b, T+A*B, kv*d)
            q = q.view(b, queries, proj.heads, proj.head_dim)
        else:
            q = proj.q(h).view(b, queries, proj.heads, proj.head_dim)
            k, v = linear(torch.cat((context, h), dim=1), kv_weight).chunk(2, dim=-1)  # (b, T+A*B, kv*d) each
        keys = k.shape[1]
        q = apply_rope(proj.q_norm(q).transpose(1, 2), *rope_q)  # (b, h, A*B, d)
        k = apply_rope(proj.k_norm(k.view(b, keys, proj.kv_heads, proj.head_dim)).transpose(1, 2), *rope_kv)
        v = v.view(b, keys, proj.kv_heads, proj.head_dim).transpose(1, 2)  # (b, kv, T+A*B, d)
        if isinstance(mask, torch.Tensor):
            attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        else:
            attn = flex_attention(q, k, v, mask)  # (b, h, A*B, d)
        x = x + proj.output(attn)
        gate, up = linear(layer.mlp_norm(x), torch.cat((mlp.gate.weight, mlp.up.weight))).chunk(2, dim=-1)
        return x + mlp.down(torch.nn.functional.silu(gate) * up)


def probe_drafter_variants(args, cfg, out: Path) -> None:
    """One drafter layer forward + backward (drafter_layer_ab): today vs k/v + gate/up fused (concatenated
    inside the compiled region) vs q/k/v fused on the block."""
    drafter_layer_ab(args, cfg, out, "drafter-variants", {
        "today": lambda layer: copy.copy(layer), "fused-kv-gateup": FusedDrafterLayer,
        "fused-qkv-block": lambda layer: FusedDrafterLayer(layer, qkv_block=True)})


def drafter_layer_ab(args, cfg, out: Path, part: str, variants: dict) -> None:
    """One drafter layer forward + backward under bf16 autocast (fp32 parameters, its FlexAttention BlockMask
    on CUDA, the dense SDPA mask on the CPU), compiled as compile scope `layers` compiles it under nographs,
    as each of `variants` (name -> a module made from the layer) makes it, in this one process. The variants
    share one layer's parameters; rel_err (against the first) of the output, the gradients of the block stream
    and of the context, and those of the k and up weights."""
    device, b = probe_device(), cfg.data.batch
    with_layers = [copy.deepcopy(cfg) for _ in range(2)]
    with_layers[0].drafter.layers, with_layers[1].drafter.layers = 1, 0
    one, none = (flops_per_sample(c)["drafter"] for c in with_layers)
    flops = (one - none) * b  # forward + backward of one drafter layer, counted by trainer/flops.py
    drafter, inputs = drafter_layer_inputs(cfg, device)
    layer, (x, context) = drafter.layers[0], inputs[:2]
    reference = None
    for name in chosen(args, variants):
        torch._dynamo.reset()
        module = variants[name](layer)
        module.compile(**COMPILE_KWARGS["nographs"])

        def call(fn=module) -> torch.Tensor:
            x.grad = context.grad = None
            layer.zero_grad(set_to_none=True)
            with torch.autocast(device.split(":")[0], dtype=torch.bfloat16):
                out_ = fn(*inputs)  # (b, A*B, H)
            out_.float().pow(2).mean().backward()
            return out_

        reset_peak()
        first, ms, spread = first_and_steady(call, args.steps)
        out_ = call()
        grads = (out_.detach(), x.grad.detach().clone(), context.grad.detach().clone(),
                 layer.proj.k.weight.grad.detach().clone(), layer.mlp.up.weight.grad.detach().clone())
        reference = reference or grads
        emit(out, part=part, variant=name, first_s=round(first, 1), ms=round(ms, 3), spread_ms=spread,
             tflops=round(flops / ms / 1e9, 1), mfu=round(flops / (ms / 1e3) / PEAK, 3), peak_gb=peak_gb(),
             rel_err=[rel_err(g, r) for g, r in zip(grads, reference)], kernels=cuda_kernels(call, rows=args.rows))


def apply_rope_heads_last(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """trainer.model.apply_rope for x laid out (b, L, h, d), as the projections give it: cos/sin (L, d/2) or
    (b, L, d/2) broadcast over the heads."""
    cos, sin = cos[..., None, :], sin[..., None, :]  # (L, 1, d/2) or (b, L, 1, d/2)
    x1, x2 = x.float().chunk(2, dim=-1)  # (b, L, h, d/2) each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)  # (b, L, h, d)


def rope_first_qkv(proj, q_in, kv_in, rope_q, rope_kv):
    """Queries, keys and values as Projections.queries/keys_values and apply_rope make them, the rotation done
    on the (b, L, heads, d) projection before the heads are moved forward: each a (b, heads, L, d) view of a
    (b, L, heads, d) buffer, as v already is, instead of a new (b, heads, L, d) buffer."""
    b, queries, kv_len = q_in.shape[0], q_in.shape[1], kv_in.shape[1]
    q = proj.q_norm(proj.q(q_in).view(b, queries, proj.heads, proj.head_dim))  # (b, L, h, d)
    k = proj.k_norm(proj.k(kv_in).view(b, kv_len, proj.kv_heads, proj.head_dim))  # (b, L', kv, d)
    v = proj.v(kv_in).view(b, kv_len, proj.kv_heads, proj.head_dim)  # (b, L', kv, d)
    q, k = apply_rope_heads_last(q, *rope_q), apply_rope_heads_last(k, *rope_kv)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (b, h|kv, L|L', d)


class RopeFirstDrafterLayer(torch.nn.Module):
    """A DrafterLayer (its own parameters) with q/k rotated before their heads are moved forward
    (rope_first_qkv): FlexAttention then gets q/k/v, and gives its output and takes its output's gradient,
    in the (b, L, h, d) order the projections use, where today q/k are new (b, h, L, d) buffers, so the output
    is one too while its gradient (from the o projection) is (b, L, h, d): the backward's delta = rowsum(dO * O)
    reads two layouts, and transposing copies are made around the kernels."""

    def __init__(self, layer) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x, context, rope_q, rope_kv, mask) -> torch.Tensor:
        from trainer.model import flex_attention

        layer = self.layer
        h = layer.attn_norm(x)  # (b, A*B, H)
        q, k, v = rope_first_qkv(layer.proj, h, torch.cat((context, h), dim=1), rope_q, rope_kv)
        if isinstance(mask, torch.Tensor):
            attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        else:
            attn = flex_attention(q, k, v, mask)  # (b, h, A*B, d)
        x = x + layer.proj.output(attn)
        return x + layer.mlp(layer.mlp_norm(x))


class RopeFirstTargetLayer(torch.nn.Module):
    """A TargetLayer (its own parameters) with q/k rotated before their heads are moved forward, so SDPA gets
    and (cuDNN: an output laid out like its query) gives (b, L, h, d) buffers and the o projection's input is a
    view, not a copy."""

    def __init__(self, layer) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        h = layer.attn_norm(x)  # (b, T, H)
        q, k, v = rope_first_qkv(layer.proj, h, h, (cos, sin), (cos, sin))  # (b, h|kv, T, d)
        attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + layer.proj.output(attn)
        return x + layer.mlp(layer.mlp_norm(x))


def probe_attention_layout(args, cfg, out: Path) -> None:
    """Where the attention's q/k are rotated, today (after moving the heads forward: new (b, h, L, d) buffers)
    vs first (rope_first_qkv: views of the projections' (b, L, h, d) order): one drafter layer forward +
    backward (drafter_layer_ab), then one target layer forward (bf16, no grad, compiled as compile_target
    compiles it), each A/B in this one process; the kernels listed show which copies go."""
    drafter_layer_ab(args, cfg, out, "attention-layout", {"today": lambda layer: copy.copy(layer),
                                                           "rope-first": RopeFirstDrafterLayer})
    from trainer.model import TargetLayer

    device, b, seq = probe_device(), cfg.data.batch, cfg.data.seq_len
    flops = flops_per_sample(cfg)["target"] / (max(tap_layers(cfg.target.layers, cfg.drafter.taps)) + 1) * b
    torch.manual_seed(0)
    with torch.device(device):
        layer = TargetLayer(cfg.target).to(torch.bfloat16).requires_grad_(False)
        x = torch.randn(b, seq, cfg.target.hidden, dtype=torch.bfloat16)
    cos, sin = Rotary(cfg.target.hidden // cfg.target.heads, cfg.target.rope_theta).to(device)(
        torch.arange(seq, device=device))  # (T, d/2) each
    reference = None
    for name, make in (("target-today", copy.copy), ("target-rope-first", RopeFirstTargetLayer)):
        torch._dynamo.reset()
        module = make(layer)
        module.compile(**COMPILE_KWARGS["nographs"])
        with torch.no_grad():
            first, ms, spread = first_and_steady(lambda: module(x, cos, sin), args.steps)
            out_ = module(x, cos, sin)
            kernels = cuda_kernels(lambda: module(x, cos, sin), rows=args.rows)
        reference = out_ if reference is None else reference
        emit(out, part="attention-layout", variant=name, first_s=round(first, 1), ms=round(ms, 3), spread_ms=spread,
             tflops=round(flops / ms / 1e9, 1), mfu=round(flops / (ms / 1e3) / PEAK, 3),
             rel_err=rel_err(out_, reference), kernels=kernels)


PARTS = {"target": probe_target, "drafter": probe_drafter, "layer": probe_region, "head": probe_region,
         "attention": probe_attention, "flash": probe_flash, "ceiling": probe_ceiling, "optimizer": probe_optimizer, "mask": probe_mask}
VARIANT_PARTS = {"target-variants": probe_target_variants, "head-variants": probe_head_variants,
                 "drafter-variants": probe_drafter_variants, "attention-layout": probe_attention_layout}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--part", choices=(*PARTS, *VARIANT_PARTS), required=True)
    parser.add_argument("--mode", default="whole", help="drafter: whole | layers (drafter.compile_scope)")
    parser.add_argument("--strategy", default="nographs")
    parser.add_argument("--preset", default="qwen3-8b-shape")
    parser.add_argument("--steps", type=int, help="timed steps (default 15; 8 for the *-variants parts)")
    parser.add_argument("--rows", type=int, default=18, help="kernels listed in the profiles")
    parser.add_argument("--gemm-scale", type=float, default=1.0,
                        help="ceiling: the weights' and output gradients' std against N(0, 1) activations "
                             "(0.02 = the drafter's init; a GEMM's speed on the H200 depends on its data)")
    parser.add_argument("--variants", type=lambda text: text.split(","), default=None,
                        help="target-/drafter-variants: the variants to run, comma-separated (default all)")
    parser.add_argument("--chunks", type=lambda text: [int(c) for c in text.split(",")], default=[1024, 2048, 4096, 8192],
                        help="head-variants: the drafter.loss_chunk values, comma-separated")
    parser.add_argument("--no-whole", dest="whole", action="store_false",
                        help="target-variants: the one layer only, not the whole forward")
    parser.add_argument("--before", action="store_true",
                        help="drafter: also time the step with the BlockMask and clipping as before, alternated")
    args = parser.parse_args()
    args.steps = args.steps or (8 if args.part in VARIANT_PARTS else 15)
    args.out.mkdir(parents=True, exist_ok=True)
    cfg = preset(args.preset)
    emit(args.out, part=args.part, preset=args.preset, taps=tap_layers(cfg.target.layers, cfg.drafter.taps),
         torch=torch.__version__, gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
    {**PARTS, **VARIANT_PARTS}[args.part](args, cfg, args.out)


if __name__ == "__main__":
    main()
