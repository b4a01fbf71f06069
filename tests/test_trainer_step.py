"""The drafter step's overheads outside the big kernels (issue 16), on CPU: each cut keeps the maths."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.attention.flex_attention as flex_attention_module
from torch.nn.attention.flex_attention import create_block_mask, create_mask

from trainer.config import build_config
from trainer.model import BlockLayout, FlexMaskBuilder, _block_mask_mod, dense_mask
from trainer.replica import build_optimizer, clipped_step, seeded_drafter


def tiny_drafter():
    cfg = build_config("tiny-cpu", [])
    return cfg, seeded_drafter(cfg, "cpu")


def gradients(params, step: int, scale: float) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return [torch.randn(p.shape, generator=generator) * scale for p in params]


def test_clipping_folded_into_fused_adamw_gives_the_update_of_clip_grad_norm_then_step(monkeypatch):
    cfg, drafter = tiny_drafter()
    other = copy.deepcopy(drafter)
    folded_opt, _ = build_optimizer(cfg, drafter)
    today_opt, _ = build_optimizer(cfg, other)
    assert folded_opt.defaults["fused"]
    folded, today = list(drafter.parameters()), list(other.parameters())
    scales = []
    monkeypatch.setattr(torch, "_foreach_mul_", lambda *a: scales.append(a))  # counts only the folded path
    for step in range(12):
        scale = 1e-2 if step % 3 else 1e-4  # norms above the clip (scaled) and below it (left alone)
        for params in (folded, today):
            for param, grad in zip(params, gradients(params, step, scale)):
                param.grad = grad
        norm = clipped_step(folded_opt, folded, cfg.optim.grad_clip)
        monkeypatch.undo()
        expected = torch.nn.utils.clip_grad_norm_(today, cfg.optim.grad_clip)
        today_opt.step()
        monkeypatch.setattr(torch, "_foreach_mul_", lambda *a: scales.append(a))
        assert torch.equal(norm, expected)  # the same norm, from the same helper
        for mine, theirs in zip(folded, today):
            torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-6, atol=0)  # scaled the same
            torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-9)
    assert scales == []  # no separate pass scaled the gradients
    assert not hasattr(folded_opt, "grad_scale")  # left for no later step (a checkpoint, GradScaler)


def test_an_optimizer_restored_unfused_still_clips_by_the_same_norm():
    cfg, drafter = tiny_drafter()
    other = copy.deepcopy(drafter)
    optimizer, _ = build_optimizer(cfg, drafter)
    old = torch.optim.AdamW(other.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    optimizer.load_state_dict(old.state_dict())  # a checkpoint of a CPU run from before: fused=False
    mine, theirs = list(drafter.parameters()), list(other.parameters())
    for params in (mine, theirs):
        for param, grad in zip(params, gradients(params, 0, 1e-2)):
            param.grad = grad
    norm = clipped_step(optimizer, mine, cfg.optim.grad_clip)
    # the same norm and the same step, to float rounding: a norm is a reduction that CPU threads may sum in another
    # order (torch.equal failed once in a loaded suite run, then passed 300 times alone)
    close = {"rtol": 1e-6, "atol": 1e-9}
    torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(theirs, cfg.optim.grad_clip), **close)
    old.step()
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, **close)


def sorted_anchors(b: int, num_anchors: int, block: int, context_len: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    picks = [torch.randperm(context_len - block + 1, generator=generator)[:num_anchors] for _ in range(b)]
    return torch.sort(torch.stack(picks), dim=1).values  # (b, A), the last anchor may be T - B


def reference_block_mask(layout: BlockLayout):
    query_anchor = layout.query_anchor()
    b, num_queries = query_anchor.shape
    return create_block_mask(_block_mask_mod(query_anchor, layout.context_len, layout.block_size), b, None,
                             num_queries, layout.context_len + num_queries, device="cpu")


def assert_same_block_mask(mine, reference) -> None:
    for ours, theirs in zip(mine.as_tuple(), reference.as_tuple(), strict=True):
        if isinstance(theirs, torch.Tensor):
            assert ours.dtype == theirs.dtype and ours.stride() == theirs.stride()  # no recompile
            assert torch.equal(ours, theirs)
        elif not callable(theirs):
            assert ours == theirs


@pytest.mark.parametrize("b,num_anchors,block,context_len", [
    (2, 512, 16, 2048),  # qwen3-8b-shape: 2 x 8192 queries x 10240 keys
    (1, 64, 16, 8192),  # a long context, sparse anchors
    (1, 32, 16, 128),  # tiny-cpu: more queries than context
    (3, 40, 16, 1000),  # T and A*B not multiples of the 128 tile: padded rows and keys
    (2, 7, 12, 300),  # a block size that does not divide the tile
    (1, 3, 200, 700),  # blocks wider than a tile
])
def test_mask_builder_gives_create_block_mask_tables_without_evaluating_the_mask(monkeypatch, b, num_anchors,
                                                                                  block, context_len):
    builder = FlexMaskBuilder()
    for seed in range(2):  # a second step overwrites the anchors in place
        layout = BlockLayout(sorted_anchors(b, num_anchors, block, context_len, seed), block, context_len)
        reference = reference_block_mask(layout)
        with monkeypatch.context() as patched:  # the b x Q x KV mask is what the step no longer builds
            patched.setattr(flex_attention_module, "create_mask", lambda *a, **k: pytest.fail("dense mask built"))
            mine = builder(layout)
        assert_same_block_mask(mine, reference)
        queries, keys = mine.seq_lengths  # inside partial tiles its mask_mod reads this step's anchors
        assert torch.equal(create_mask(mine.mask_mod, b, 1, queries, keys, "cpu"), dense_mask(layout))
