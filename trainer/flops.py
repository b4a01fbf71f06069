"""Counted model FLOPs per training sample, for MFU: matmuls and attention only (elementwise ignored).

Counts what the trainer computes: the target forward up to the last tapped layer, the drafter's forward
and backward (3x forward; weight and input gradients), and the frozen vocab head's forward plus its input
gradient (2x forward; no weight gradient). Attention is counted only where the mask lets a query see.
Pure arithmetic on the config; no torch.
"""

from __future__ import annotations

from trainer.config import Config, tap_layers


def _layer_matmul_flops(cfg: Config, queries: int, keys: int) -> float:
    """Projections + SwiGLU of one decoder layer: q/o on the queries, k/v on the keys."""
    t = cfg.target
    head_dim = t.hidden // t.heads
    q_o = 2 * queries * t.hidden * t.heads * head_dim * 2
    k_v = 2 * keys * t.hidden * t.kv_heads * head_dim * 2
    mlp = 2 * queries * t.hidden * t.intermediate * 3
    return q_o + k_v + mlp


def _attention_flops(cfg: Config, visible_pairs: float) -> float:
    """QK^T and PV over the visible (query, key) pairs, all heads."""
    return 2 * 2 * visible_pairs * cfg.target.hidden


def flops_per_sample(cfg: Config) -> dict[str, float]:
    t, d = cfg.target, cfg.drafter
    seq, anchors, block = cfg.data.seq_len, d.anchors, d.block_size
    target_layers = max(tap_layers(t.layers, d.taps)) + 1
    causal_pairs = seq * (seq + 1) / 2
    target = target_layers * (_layer_matmul_flops(cfg, seq, seq) + _attention_flops(cfg, causal_pairs))
    block_tokens = anchors * block
    mean_anchor = (seq - block) / 2  # anchors are uniform over [0, T-B]: a query sees ~mean_anchor context keys
    drafter_pairs = block_tokens * (mean_anchor + block)
    drafter_fwd = 2 * seq * d.taps * t.hidden * t.hidden + d.layers * (
        _layer_matmul_flops(cfg, block_tokens, seq + block_tokens) + _attention_flops(cfg, drafter_pairs)
    )
    head_fwd = 2 * anchors * (block - 1) * t.hidden * t.vocab_size
    return {"target": float(target), "drafter": 3.0 * drafter_fwd, "head": 2.0 * head_fwd,
            "total": float(target + 3.0 * drafter_fwd + 2.0 * head_fwd)}
