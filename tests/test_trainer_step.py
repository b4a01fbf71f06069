"""The drafter step's overheads outside the big kernels (issue 16), on CPU: each cut keeps the maths."""

from __future__ import annotations

import copy

import torch

from trainer.config import build_config
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
    folded_opt, _ = build_optimizer(cfg, drafter, "cpu")
    today_opt, _ = build_optimizer(cfg, other, "cpu")
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
    optimizer, _ = build_optimizer(cfg, drafter, "cpu")
    old = torch.optim.AdamW(other.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    optimizer.load_state_dict(old.state_dict())  # a checkpoint of a CPU run from before: fused=False
    mine, theirs = list(drafter.parameters()), list(other.parameters())
    for params in (mine, theirs):
        for param, grad in zip(params, gradients(params, 0, 1e-2)):
            param.grad = grad
    norm = clipped_step(optimizer, mine, cfg.optim.grad_clip)
    assert torch.equal(norm, torch.nn.utils.clip_grad_norm_(theirs, cfg.optim.grad_clip))
    old.step()
    assert all(torch.equal(a, b) for a, b in zip(mine, theirs))
