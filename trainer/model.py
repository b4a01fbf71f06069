"""The models: a frozen Llama-style target that returns tapped hidden states, and the DFlash block drafter.

What is here: the target (RMSNorm, RoPE, GQA, SwiGLU; seeded random init, or a local Hugging Face model),
the drafter (feature fusion + layers whose queries come from block tokens and whose keys/values come from
[fused context; block]), the block/context attention mask (FlexAttention BlockMask on CUDA, dense boolean
mask for SDPA elsewhere) and the weighted block loss with its metrics. What is not: devices, threads,
optimizers, compilation or I/O; those live in pipeline.py and compile.py.

Shapes: b = samples, T = context tokens, A = anchors per sample, B = block size, H = hidden, V = vocab,
K = tapped layers, N = b*A*(B-1) predicted positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from trainer.config import Config, ConfigError, DrafterConfig, TargetConfig, tap_layers


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)


class Rotary(nn.Module):
    """RoPE (rotate-half form, as in Llama/Qwen) for arbitrary integer positions."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq  # (..., L, d/2)
        return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (b, h, L, d); cos/sin (L, d/2) or (b, L, d/2)."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]  # (b, 1, L, d/2)
    x1, x2 = x.float().chunk(2, dim=-1)  # (b, h, L, d/2) each
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # (b, h, L, d)
    return rotated.to(x.dtype)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, inner, bias=False)
        self.up = nn.Linear(hidden, inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Projections(nn.Module):
    """q/k/v/o projections (+ optional per-head q/k RMSNorm) shared by target and drafter attention."""

    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads = cfg.heads, cfg.kv_heads
        self.head_dim = cfg.hidden // cfg.heads
        self.q = nn.Linear(cfg.hidden, cfg.heads * self.head_dim, bias=False)
        self.k = nn.Linear(cfg.hidden, cfg.kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(cfg.hidden, cfg.kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(cfg.heads * self.head_dim, cfg.hidden, bias=False)
        self.q_norm = RMSNorm(self.head_dim) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(self.head_dim) if cfg.qk_norm else nn.Identity()

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        b, length, _ = x.shape
        q = self.q(x).view(b, length, self.heads, self.head_dim)  # (b, L, h, d)
        return self.q_norm(q).transpose(1, 2)  # (b, h, L, d)

    def keys_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, length, _ = x.shape
        k = self.k(x).view(b, length, self.kv_heads, self.head_dim)  # (b, L, kv, d)
        v = self.v(x).view(b, length, self.kv_heads, self.head_dim)  # (b, L, kv, d)
        return self.k_norm(k).transpose(1, 2), v.transpose(1, 2)  # (b, kv, L, d) each

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        b, _, length, _ = attn.shape
        return self.o(attn.transpose(1, 2).reshape(b, length, -1))  # (b, L, H)


class TargetLayer(nn.Module):
    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden)
        self.proj = Projections(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden)
        self.mlp = SwiGLU(cfg.hidden, cfg.intermediate)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = self.attn_norm(x)  # (b, T, H)
        q = apply_rope(self.proj.queries(h), cos, sin)  # (b, h, T, d)
        k, v = self.proj.keys_values(h)  # (b, kv, T, d)
        k = apply_rope(k, cos, sin)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # (b, h, T, d)
        x = x + self.proj.output(attn)
        return x + self.mlp(self.mlp_norm(x))


class TargetModel(nn.Module):
    """Frozen Llama-style causal LM. `features` runs only the layers up to the last tap."""

    def __init__(self, cfg: TargetConfig, taps: list[int]) -> None:
        super().__init__()
        self.cfg, self.taps = cfg, taps
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.rotary = Rotary(cfg.hidden // cfg.heads, cfg.rope_theta)
        self.layers = nn.ModuleList(TargetLayer(cfg) for _ in range(max(taps) + 1))
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
        nn.init.normal_(self.embed.weight, std=cfg.init_std)
        nn.init.normal_(self.lm_head.weight, std=cfg.init_std)
        self.requires_grad_(False)

    @torch.no_grad()
    def features(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (b, T) -> concatenated hidden states of the tapped layers (b, T, K*H)."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)  # (T,)
        cos, sin = self.rotary(positions)  # (T, d/2)
        x = self.embed(tokens)  # (b, T, H)
        tapped = []
        for index, layer in enumerate(self.layers):
            x = layer(x, cos, sin)  # (b, T, H)
            if index in self.taps:
                tapped.append(x)
        return torch.cat(tapped, dim=-1)  # (b, T, K*H)


class HFTarget(nn.Module):
    """A local Hugging Face causal LM behind the same interface (embed, lm_head, features).

    The config must describe it (target.layers, target.hidden, target.vocab_size): taps, the drafter's
    shapes and the MASK id (vocab_size - 1) are derived from those fields.
    """

    def __init__(self, cfg: TargetConfig, taps: list[int], dtype: torch.dtype) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM  # optional dependency, only when configured

        self.model = AutoModelForCausalLM.from_pretrained(cfg.hf_path, local_files_only=True, dtype=dtype)
        self.taps = taps
        self.embed = self.model.get_input_embeddings()
        self.lm_head = self.model.get_output_embeddings()
        self.requires_grad_(False)
        hf = self.model.config
        found = {"layers": hf.num_hidden_layers, "hidden": hf.hidden_size, "vocab_size": self.embed.num_embeddings}
        for key, value in found.items():
            if getattr(cfg, key) != value:
                raise ConfigError(f"target.{key}: expected {value} for {cfg.hf_path} (--set target.{key}={value})")

    @torch.no_grad()
    def features(self, tokens: torch.Tensor) -> torch.Tensor:
        out = self.model.get_decoder()(input_ids=tokens, output_hidden_states=True)  # no vocab logits
        return torch.cat([out.hidden_states[i + 1] for i in self.taps], dim=-1)  # (b, T, K*H)


def build_target(cfg: Config, device: str = "cpu") -> nn.Module:
    """Seeded by run.seed; random weights are drawn directly on `device` (fast for 8B shapes on a GPU)."""
    taps = tap_layers(cfg.target.layers, cfg.drafter.taps)
    if cfg.target.hf_path:
        return HFTarget(cfg.target, taps, model_dtype(cfg)).to(device).eval()
    torch.manual_seed(cfg.run.seed)
    with torch.device(device):
        return TargetModel(cfg.target, taps).eval()


def model_dtype(cfg: Config) -> torch.dtype:
    return torch.bfloat16 if cfg.run.dtype == "bf16" else torch.float32


# ----------------------------------------------------------------------------------------- attention mask


@dataclass
class BlockLayout:
    """Where each block sits: anchors (b, A) sorted, block size B, context length T."""

    anchors: torch.Tensor
    block_size: int
    context_len: int

    def query_anchor(self) -> torch.Tensor:
        return self.anchors.repeat_interleave(self.block_size, dim=1)  # (b, A*B)

    def positions(self) -> torch.Tensor:
        offsets = torch.arange(self.block_size, device=self.anchors.device)  # (B,)
        return (self.anchors[..., None] + offsets).flatten(1)  # (b, A*B)


def dense_mask(layout: BlockLayout) -> torch.Tensor:
    """(b, 1, A*B, T+A*B) bool: context strictly before the anchor, plus the query's own block."""
    b, num_anchors = layout.anchors.shape
    num_queries = num_anchors * layout.block_size
    device = layout.anchors.device
    ctx_pos = torch.arange(layout.context_len, device=device)  # (T,)
    sees_ctx = ctx_pos[None, None, :] < layout.query_anchor()[..., None]  # (b, A*B, T)
    block_id = torch.arange(num_queries, device=device) // layout.block_size  # (A*B,)
    sees_block = block_id[:, None] == block_id[None, :]  # (A*B, A*B)
    sees_block = sees_block.expand(b, num_queries, num_queries)  # (b, A*B, A*B)
    return torch.cat((sees_ctx, sees_block), dim=-1)[:, None]  # (b, 1, A*B, T+A*B)


def _block_mask_mod(query_anchor: torch.Tensor, context_len: int, block_size: int):
    """mask_mod of the block/context mask: a query sees the context strictly before its anchor and its own
    block."""

    def mask_mod(b, h, q_idx, kv_idx):
        in_context = kv_idx < query_anchor[b, q_idx]
        offset = kv_idx - context_len
        return in_context | ((offset >= 0) & (offset // block_size == q_idx // block_size))

    return mask_mod


def flex_block_mask(layout: BlockLayout):
    """The same mask as a FlexAttention BlockMask (skips fully masked tiles), built inside the compiled
    training forward (compile scope `whole`): the mask_mod closure is created in the traced frame, so the
    compiler never guards on (or recompiles for) a Python function that changes every step."""
    from torch.nn.attention.flex_attention import create_block_mask

    query_anchor = layout.query_anchor()  # (b, A*B)
    b, num_queries = query_anchor.shape
    mask_mod = _block_mask_mod(query_anchor, layout.context_len, layout.block_size)
    return create_block_mask(mask_mod, b, None, num_queries, layout.context_len + num_queries,
                             device=query_anchor.device)


MASK_TILE = 128  # FlexAttention's default sparse block size (create_block_mask's BLOCK_SIZE)


def visible_pairs_per_tile(query_anchor: torch.Tensor, context_len: int, block_size: int,
                           tile: int = MASK_TILE) -> torch.Tensor:
    """How many (query, key) pairs of each tile x tile square the block/context mask lets through, (b, Qt, KVt),
    counted per query row from its anchor: a query sees the context keys [0, anchor) and its own block's keys
    [T + (q // B) * B, + B), so each row's count in a key tile is an interval length. b*Q*KVt work, 1/tile of
    the b*Q*KV mask that create_block_mask evaluates. Rows and keys past the ends count as masked, as
    create_block_mask pads them. Assumes anchor <= T (an anchor is a context position)."""
    b, num_queries = query_anchor.shape
    kv_len = context_len + num_queries
    q_tiles, kv_tiles = -(-num_queries // tile), -(-kv_len // tile)
    device = query_anchor.device
    starts = torch.arange(kv_tiles, device=device) * tile  # (KVt,)
    ends = (starts + tile).clamp(max=kv_len)  # (KVt,)
    context_ends = ends.clamp(max=context_len)  # (KVt,)
    seen_context = (torch.minimum(query_anchor[..., None], context_ends) - starts).clamp(min=0)  # (b, Q, KVt)
    own_block = context_len + torch.arange(num_queries, device=device) // block_size * block_size  # (Q,)
    seen_block = (torch.minimum(ends, own_block[:, None] + block_size)
                  - torch.maximum(starts, own_block[:, None])).clamp(min=0)  # (Q, KVt)
    per_row = F.pad(seen_context + seen_block, (0, 0, 0, q_tiles * tile - num_queries))  # (b, Qt*tile, KVt)
    return per_row.view(b, q_tiles, tile, kv_tiles).sum(dim=2)  # (b, Qt, KVt)


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A (b, 1, Qt, KVt) tile table as BlockMask rows: how many tiles each row has, and their indices first
    (ascending), then the others (create_block_mask's own ordering)."""
    dense = dense.to(torch.int32)
    count = dense.sum(dim=-1).to(torch.int32)  # (b, 1, Qt)
    indices = torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)  # (b, 1, Qt, KVt)
    return count, indices


def block_mask_from_anchors(query_anchor: torch.Tensor, context_len: int, block_size: int, mask_mod):
    """The BlockMask create_block_mask(mask_mod, b, None, Q, T+Q) gives for the block/context mask (the same
    tables, tile for tile), from per-row interval counts instead of the mask itself: a tile is full when
    every pair is visible, partial when some are; `mask_mod` (reading `query_anchor`) masks inside the
    partial tiles."""
    from torch.nn.attention.flex_attention import BlockMask

    visible = visible_pairs_per_tile(query_anchor, context_len, block_size)[:, None]  # (b, 1, Qt, KVt)
    full = visible == MASK_TILE * MASK_TILE
    partial = (visible > 0) & ~full
    num_queries = query_anchor.shape[1]
    return BlockMask.from_kv_blocks(*_ordered(partial), *_ordered(full), BLOCK_SIZE=(MASK_TILE, MASK_TILE),
                                    mask_mod=mask_mod, seq_lengths=(num_queries, context_len + num_queries))


class FlexMaskBuilder:
    """Builds the BlockMask outside the compiled regions (compile scope `layers`), one builder per replica.

    Its mask_mod is created once and reads a persistent per-query anchor buffer that each step overwrites in
    place: the compiled layers see the same function every step (no guard failure, no recompilation) and
    CUDA graphs read the anchors at a fixed address. The block tables are counted from the anchors
    (block_mask_from_anchors: a few small passes over b x Q x KV/128, not the b x Q x KV mask that
    create_block_mask evaluates eagerly every step); compiling create_block_mask (its `_compile=True`, or
    tracing it inside a compiled forward as scope `whole` does) took ~165 s of Triton compilation for
    qwen3-8b-shape on the H200 (bench/gpu_probe.py --part layer), most of that preset's first-step time."""

    def __init__(self) -> None:
        self.query_anchor: torch.Tensor | None = None  # (b, A*B)
        self.mask_mod = None
        self.layout_key: tuple[int, ...] = ()  # (b, A*B, T, B) the buffer and mask_mod were made for

    def __call__(self, layout: BlockLayout):
        query_anchor = layout.query_anchor()  # (b, A*B)
        layout_key = (*query_anchor.shape, layout.context_len, layout.block_size)
        if layout_key != self.layout_key:
            self.query_anchor = torch.empty_like(query_anchor)
            self.layout_key = layout_key
            self.mask_mod = _block_mask_mod(self.query_anchor, layout.context_len, layout.block_size)
        self.query_anchor.copy_(query_anchor)
        return block_mask_from_anchors(self.query_anchor, layout.context_len, layout.block_size, self.mask_mod)


def flex_attention(q, k, v, block_mask):
    from torch.nn.attention.flex_attention import flex_attention as flex

    return flex(q, k, v, block_mask=block_mask, enable_gqa=True)


# ------------------------------------------------------------------------------------------------ drafter


class DrafterLayer(nn.Module):
    """Queries from the block; keys/values from [fused context; block] through the same projections."""

    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden)
        self.proj = Projections(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden)
        self.mlp = SwiGLU(cfg.hidden, cfg.intermediate)

    def forward(self, x, context, rope_q, rope_kv, mask) -> torch.Tensor:
        h = self.attn_norm(x)  # (b, A*B, H)
        q = apply_rope(self.proj.queries(h), *rope_q)  # (b, h, A*B, d)
        k, v = self.proj.keys_values(torch.cat((context, h), dim=1))  # (b, kv, T+A*B, d)
        k = apply_rope(k, *rope_kv)
        if isinstance(mask, torch.Tensor):
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # (b, h, A*B, d)
        else:
            attn = flex_attention(q, k, v, mask)  # (b, h, A*B, d)
        x = x + self.proj.output(attn)
        return x + self.mlp(self.mlp_norm(x))


class Drafter(nn.Module):
    """The trainable part: fusion of K tapped layers, N drafter layers, final norm."""

    def __init__(self, target_cfg: TargetConfig, drafter_cfg: DrafterConfig) -> None:
        super().__init__()
        hidden = target_cfg.hidden
        self.fuse = nn.Linear(drafter_cfg.taps * hidden, hidden, bias=False)
        self.fuse_norm = RMSNorm(hidden)
        self.rotary = Rotary(hidden // target_cfg.heads, target_cfg.rope_theta)
        self.layers = nn.ModuleList(DrafterLayer(target_cfg) for _ in range(drafter_cfg.layers))
        self.norm = RMSNorm(hidden)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
        for layer in self.layers:  # scaled residual outputs, as in GPT-2
            nn.init.normal_(layer.proj.o.weight, std=0.02 / math.sqrt(2 * drafter_cfg.layers))
            nn.init.normal_(layer.mlp.down.weight, std=0.02 / math.sqrt(2 * drafter_cfg.layers))

    def forward(self, features, block_input, layout: BlockLayout, mask) -> torch.Tensor:
        """features (b, T, K*H), block_input (b, A*B, H) -> block hidden states (b, A*B, H)."""
        context = self.fuse_norm(self.fuse(features))  # (b, T, H)
        block_pos = layout.positions()  # (b, A*B)
        ctx_pos = torch.arange(layout.context_len, device=block_pos.device).expand(block_pos.shape[0], -1)
        rope_q = self.rotary(block_pos)  # (b, A*B, d/2) x2
        rope_kv = self.rotary(torch.cat((ctx_pos, block_pos), dim=1))  # (b, T+A*B, d/2) x2
        x = block_input
        for layer in self.layers:
            x = layer(x, context, rope_q, rope_kv, mask)  # (b, A*B, H)
        return self.norm(x)


# ------------------------------------------------------------------------------------- head + block loss


class FusedHeadCrossEntropy(torch.autograd.Function):
    """Frozen vocab head + weighted cross-entropy, chunked over rows, gradient computed in the forward.

    Never materialises the full (N, V) fp32 logits: each chunk's logits are turned into its loss, its
    argmax and its input gradient at once, so the backward only scales the stored input gradient. The head
    weight is frozen, so no weight gradient is formed. Returns (weighted loss, argmax per row).
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, row_weights, chunk: int):
        # hidden (N, H) contiguous; weight (V, H); labels (N,); row_weights (N,) summing to 1
        loss = hidden.new_zeros((), dtype=torch.float32)
        grad_hidden = torch.empty_like(hidden)  # (N, H)
        predictions = torch.empty_like(labels)  # (N,)
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            logits = (hidden[rows] @ weight.t()).float()  # (c, V)
            lse = torch.logsumexp(logits, dim=-1)  # (c,)
            label_logit = logits.gather(1, labels[rows, None]).squeeze(1)  # (c,)
            w = row_weights[rows]  # (c,)
            loss = loss + ((lse - label_logit) * w).sum()
            predictions[rows] = logits.argmax(dim=-1)
            # d loss / d logits = w * (softmax - onehot(label)). The softmax part is written once, already
            # in the matmul's dtype, by the pass that reads the logits; the one-hot part is w * W[label],
            # subtracted after the matmul. An in-place scatter of -1 into the (c, V) probabilities instead
            # kept them in fp32 and cost two more passes over them: ~6 of the head's ~34 ms a sample on an
            # H200 (bench/gpu_profile_run.py).
            probs = (torch.exp(logits - lse[:, None]) * w[:, None]).to(weight.dtype)  # (c, V)
            onehot_part = w[:, None] * weight[labels[rows]].float()  # (c, H)
            grad_hidden[rows] = ((probs @ weight).float() - onehot_part).to(hidden.dtype)  # (c, H)
        ctx.save_for_backward(grad_hidden)
        ctx.mark_non_differentiable(predictions)
        return loss, predictions

    @staticmethod
    def backward(ctx, grad_loss, _grad_predictions):
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad_loss.to(grad_hidden.dtype), None, None, None, None


class HeadLoss(nn.Module):
    """The frozen vocab head + weighted block loss as a module of its own: a compile region of its own under
    compile scope `layers`. Returns (loss, argmax per row)."""

    def __init__(self, lm_head: nn.Linear, chunk: int) -> None:
        super().__init__()
        self.lm_head, self.chunk = lm_head, chunk

    def forward(self, predicted, labels, row_weights) -> tuple[torch.Tensor, torch.Tensor]:
        predicted = predicted.to(self.lm_head.weight.dtype)  # (N, H)
        return FusedHeadCrossEntropy.apply(predicted, self.lm_head.weight, labels, row_weights, self.chunk)


class DraftObjective(nn.Module):
    """One training forward: block inputs from the frozen embedding, drafter, frozen head, block loss.

    The frozen `embed` and `lm_head` are registered (the compiler needs them as module state) but only
    `drafter` is trained and checkpointed. `regions()` names what compile scope `layers` compiles: each
    drafter layer (identical code: compiled once, reused) and the head loss; the BlockMask is then built
    outside them by a per-replica FlexMaskBuilder. Under scope `whole` the strategy compiles this whole
    forward and the mask is built inside it.
    """

    def __init__(self, drafter: Drafter, embed: nn.Embedding, lm_head: nn.Linear, cfg: Config,
                 use_flex: bool) -> None:
        super().__init__()
        self.drafter, self.embed = drafter, embed
        self.head_loss = HeadLoss(lm_head, cfg.drafter.loss_chunk)
        self.use_flex = use_flex  # FlexAttention BlockMask (compiled CUDA) or a dense mask for SDPA
        self.build_mask = FlexMaskBuilder() if cfg.drafter.compile_scope == "layers" else flex_block_mask
        self.block_size = cfg.drafter.block_size
        self.mask_token = cfg.target.vocab_size - 1
        k = torch.arange(1, self.block_size, dtype=torch.float32)  # (B-1,)
        self.register_buffer("position_weight", torch.exp(-(k - 1) / cfg.drafter.gamma), persistent=False)

    def regions(self) -> list[nn.Module]:
        return [*self.drafter.layers, self.head_loss]

    def forward(self, tokens, features, anchors) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens (b, T), features (b, T, K*H), anchors (b, A) sorted; returns (loss, accuracy, accept_len)."""
        b, context_len = tokens.shape
        num_anchors, block = anchors.shape[1], self.block_size
        layout = BlockLayout(anchors, block, context_len)
        mask = self.build_mask(layout) if self.use_flex else dense_mask(layout)
        offsets = torch.arange(block, device=tokens.device)  # (B,)
        block_ids = torch.full((b, num_anchors, block), self.mask_token, device=tokens.device)  # (b, A, B)
        block_ids[:, :, 0] = tokens.gather(1, anchors)
        labels = tokens.gather(1, (anchors[..., None] + offsets[1:]).flatten(1))  # (b, A*(B-1))
        block_input = self.embed(block_ids.flatten(1)).to(features.dtype)  # (b, A*B, H)
        hidden = self.drafter(features, block_input, layout, mask)  # (b, A*B, H)
        predicted = hidden.view(b, num_anchors, block, -1)[:, :, 1:]  # (b, A, B-1, H) strided
        predicted = predicted.reshape(-1, hidden.shape[-1]).contiguous()  # (N, H): one big head matmul
        row_weights = self.position_weight.repeat(b * num_anchors)  # (N,)
        row_weights = row_weights / row_weights.sum()
        loss, argmax = self.head_loss(predicted, labels.flatten(), row_weights)
        correct = (argmax == labels.flatten()).view(b * num_anchors, block - 1)  # (b*A, B-1)
        accuracy = correct.float().mean()
        accept_len = correct.int().cumprod(dim=1).sum(dim=1).float().mean() + 1.0
        return loss, accuracy, accept_len
