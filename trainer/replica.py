"""One drafter replica and the step it takes, shared by both topologies (threads and procsplit).

What is here: building an identical replica on a device (drafter + frozen embedding/lm_head + compile
strategy + optimizer), one training step's forward/backward and optimizer step, device/stream helpers, and
the Reporter that turns step statistics into event=step lines. What is not: threads, processes, queues or
how replicas agree on gradients (pipeline.py in-process, procsplit.py through torch.distributed).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import resource
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from trainer.compile import Compiled, apply_strategy
from trainer.config import Config
from trainer.metrics import MetricLog
from trainer.model import DraftObjective, Drafter


def is_cuda(device: str) -> bool:
    return device.startswith("cuda")


def stream_for(device: str):
    """A side CUDA stream for this thread's work (none on CPU)."""
    return torch.cuda.Stream(device=device) if is_cuda(device) else None


def stream_context(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def synchronize(device: str) -> None:
    if is_cuda(device):
        torch.cuda.synchronize(device)



@dataclass
class Replica:
    index: int
    device: str
    drafter: Drafter
    compiled: Compiled
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    autocast: bool
    stream: object = None
    stats: tuple[torch.Tensor, ...] = ()


def build_optimizer(cfg: Config, drafter: nn.Module):
    """Fused AdamW on every device (CUDA, and CPU since torch 2.4): one kernel per step, which also takes the
    gradient clipping's scale (`clipped_step`)."""
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay,
                                  fused=True)
    warmup = max(cfg.optim.warmup_steps, 1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
    return optimizer, scheduler


def seeded_drafter(cfg: Config, device: str) -> Drafter:
    """The initial drafter weights, a function of run.seed (every replica starts from these)."""
    torch.manual_seed(cfg.run.seed + 1)
    with torch.device(device):
        return Drafter(cfg.target, cfg.drafter)


def build_replica(cfg: Config, index: int, device: str, prototype: Drafter, embed: nn.Module,
                  lm_head: nn.Module) -> Replica:
    """A replica on `device`: a copy of `prototype`, the frozen head, the compile strategy, an optimizer."""
    drafter = copy.deepcopy(prototype).to(device)
    objective = DraftObjective(drafter, embed, lm_head, cfg, uses_flex(cfg, device)).to(device)
    regions = objective.regions() if cfg.drafter.compile_scope == "layers" else None
    compiled = apply_strategy(cfg.run.compile, objective, cfg.run.localtls_mode, regions)
    optimizer, scheduler = build_optimizer(cfg, drafter)
    return Replica(index, device, drafter, compiled, optimizer, scheduler, autocast=cfg.run.dtype == "bf16")


def uses_flex(cfg: Config, device: str) -> bool:
    """auto: FlexAttention where it is fast (compiled, on CUDA); SDPA with a dense mask otherwise (eager
    stays free of torch.compile; FlexAttention has no CPU backward)."""
    if cfg.drafter.attention == "auto":
        return is_cuda(device) and cfg.run.compile != "eager"
    return cfg.drafter.attention == "flex"


def restore_replica(replica: Replica, state: dict) -> None:
    replica.drafter.load_state_dict(state["drafter"])
    replica.optimizer.load_state_dict(state["optimizer"])
    replica.scheduler.load_state_dict(state["scheduler"])


def forward_backward(cfg: Config, replica: Replica, tokens: torch.Tensor, features: torch.Tensor,
                     anchors: torch.Tensor) -> None:
    """One forward and backward on tensors already on the replica's device; keeps detached stats."""
    replica.compiled.step_begin()
    with torch.autocast(replica.device.split(":")[0], dtype=torch.bfloat16, enabled=replica.autocast):
        loss, acc, accept = replica.compiled.step_fn(tokens, features, anchors)
    loss.backward()
    # clones: a CUDA-graph replay overwrites its outputs at the next step
    replica.stats = (loss.detach().clone(), acc.detach().clone(), accept.detach().clone())


def debug_hooks(cfg: Config, index: int, step: int) -> None:
    """Fault injection for tests (debug.*): a deliberate failure or a slow step."""
    if step == cfg.debug.fail_at_step and index == cfg.debug.fail_drafter:
        time.sleep(cfg.debug.fail_idle_s)  # no GPU work meanwhile: this drafter's GPU idles first
        raise RuntimeError(f"debug.fail_at_step={step}: injected failure in drafter {index}")
    if cfg.debug.step_sleep_s:
        time.sleep(cfg.debug.step_sleep_s)


def weights_digest(drafter: nn.Module) -> str:
    """sha256 of every parameter's bytes: equal digests mean bit-identical replicas."""
    digest = hashlib.sha256()
    for param in drafter.parameters():
        digest.update(param.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def replica_fields(digests: list[str]) -> dict[str, str]:
    """The done line's replica report: `replicas=identical|DIFFERENT replica_hashes=ab12..,ab12..` (each
    replica's weights digest, 12 hex digits, in replica/rank order)."""
    return {"replicas": "identical" if len(set(digests)) == 1 else "DIFFERENT",
            "replica_hashes": ",".join(digest[:12] for digest in digests)}


def optimizer_step(cfg: Config, replica: Replica) -> None:
    clipped_step(replica.optimizer, list(replica.drafter.parameters()), cfg.optim.grad_clip)
    replica.scheduler.step()
    # None, not zeros: under CUDA graphs a gradient is a graph output that the next replay overwrites
    replica.optimizer.zero_grad(set_to_none=True)


CLIP_EPS = 1e-6  # clip_grad_norm_'s own: its coefficient is max_norm / (norm + 1e-6)


def clipped_step(optimizer: torch.optim.Optimizer, params: list[nn.Parameter], max_norm: float) -> torch.Tensor | None:
    """clip_grad_norm_(params, max_norm) then optimizer.step(), with the clipping folded into the fused AdamW
    kernel: the total norm from clip_grad_norm_'s own helper, then the kernel divides each gradient by
    max((norm + 1e-6) / max_norm, 1) as it reads it (its `grad_scale`, meant for GradScaler; it writes the
    scaled gradient back, as the separate scaling did), so no separate pass multiplies the ~4 GB of fp32
    gradients first. The same update up to the rounding of x * c against x / (1 / c), the gradients scaled
    the same. Returns the total norm before clipping (None without clipping). A param group that is not fused
    (whose step refuses a grad_scale: e.g. restored from a CPU checkpoint written before CPU AdamW was fused)
    gets clip_grad_norm_'s own scaling pass."""
    if not max_norm:
        optimizer.step()
        return None
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    if not all(group.get("fused") for group in optimizer.param_groups):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        optimizer.step()
        return norm
    optimizer.grad_scale = torch.clamp((norm.float() + CLIP_EPS) / max_norm, min=1.0)  # read by Adam.step
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale
    return norm


class Reporter:
    """Turns step statistics into event=step lines; reads them (a device sync) only on logging steps."""

    def __init__(self, cfg: Config, log: MetricLog, start_step: int, replicas: int,
                 q_fill: Callable[[], float], active: Callable[[], int]) -> None:
        self.cfg, self.log, self.q_fill, self.active, self.replicas = cfg, log, q_fill, active, replicas
        self.warmup_end = start_step + cfg.run.warmup_log_steps
        self.tokens_per_step = replicas * cfg.data.batch * cfg.data.seq_len
        self.interval_start, self.interval_steps = time.monotonic(), 0

    def is_log_step(self, done: int) -> bool:
        """`done` = steps completed (1-based); the warm-up's last step always logs, to close its interval."""
        return done % self.cfg.run.log_every == 0 or done == self.cfg.run.steps or done == self.warmup_end

    def after_step(self, done: int, read_stats: Callable[[], tuple[float, float, float]], lr: float,
                   mem_gb: float) -> None:
        self.interval_steps += 1
        if not self.is_log_step(done):
            return
        loss, acc, accept = read_stats()
        elapsed = time.monotonic() - self.interval_start
        self.log.emit(
            "step", step=done, tok_s=self.tokens_per_step * self.interval_steps / max(elapsed, 1e-9),
            loss=loss, acc=acc, accept_len=accept, lr=lr, q_fill=self.q_fill(),
            active=f"{self.active()}/{self.replicas}", mem_gb=mem_gb,
            phase="warmup" if done <= self.warmup_end else "train",
        )
        self.interval_start, self.interval_steps = time.monotonic(), 0


def memory_gb(devices: list[str]) -> float:
    """Peak allocated GPU memory of the busiest device, or this process's peak RSS on CPU."""
    cuda_devices = {d for d in devices if is_cuda(d)}
    if cuda_devices:
        return max(torch.cuda.max_memory_allocated(d) for d in cuda_devices) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB -> GB
