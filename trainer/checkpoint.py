"""Checkpoints: drafter weights, optimizer and scheduler state and the step, written atomically.

One file per run, OUT/RUN/checkpoint.pt, replaced in place (write to a temporary name, then os.replace), so
a run killed mid-write still has its previous checkpoint. It knows nothing about threads or processes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from trainer.config import ConfigError

CHECKPOINT_NAME = "checkpoint.pt"


def checkpoint_path(run_dir: Path) -> Path:
    return run_dir / CHECKPOINT_NAME


def save_checkpoint(run_dir: Path, step: int, config_hash: str, drafter: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, scheduler: Any) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = checkpoint_path(run_dir)
    state = {
        "step": step,
        "config_hash": config_hash,
        "drafter": {k: v.detach().cpu() for k, v in drafter.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
    }
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # nodes sharing a filesystem write their own
    torch.save(state, tmp)
    os.replace(tmp, path)
    return path


def load_checkpoint(run_dir: Path, config_hash: str, mmap: bool = False) -> dict[str, Any]:
    path = checkpoint_path(run_dir)
    if not path.is_file():
        raise ConfigError(f"--resume: no checkpoint at {path} (run without --resume to start fresh)")
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    if state["config_hash"] != config_hash:
        raise ConfigError(
            f"--resume: {path} was written with config {state['config_hash']}, this run is {config_hash} "
            "(use the same preset and --set values, or a new --run-name)"
        )
    return state
