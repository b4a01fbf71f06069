"""Writes and changes the state file that drives the `nvidia-smi` stand-in (tests/harness/bin/nvidia-smi).

Tests describe GPUs here (index, name, memory, utilization, compute apps) and a mode (ok, no_devices,
no_driver, mismatch, hang); the stand-in re-reads the file on every call and every `-l`/`-lms` tick, so
a test can change load while a sampler runs. This module never runs the stand-in itself.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import STANDIN_BIN

STANDIN = STANDIN_BIN / "nvidia-smi"
STATE_ENV = "NVIDIA_SMI_STANDIN_STATE"
DEFAULT_STATE_PATH = "/run/nvidia-smi-standin.json"
MODES = ("ok", "no_devices", "no_driver", "mismatch", "hang")
H200_MEMORY_MIB = 143771


@dataclass
class GpuApp:
    pid: int
    used_memory_mib: int
    process_name: str = "python"


@dataclass
class Gpu:
    """One GPU as nvidia-smi reports it. None prints `[N/A]`; a string prints verbatim (`[Not Supported]`)."""

    index: int
    name: str = "NVIDIA H200"
    uuid: str = ""
    memory_used_mib: int | None = 0
    memory_total_mib: int | None = H200_MEMORY_MIB
    utilization_pct: int | str | None = 0
    temperature_c: int | None = 31
    power_w: float | str | None = 74.25
    apps: list[GpuApp] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.uuid:
            self.uuid = f"GPU-5f1c0a2e-0000-4000-8000-{self.index:012d}"


def idle_gpus(count: int) -> list[Gpu]:
    """`count` idle H200s, indices 0..count-1."""
    return [Gpu(index) for index in range(count)]


class NvidiaSmiState:
    """The state file at `path`. Every change rewrites it atomically (the stand-in may be reading it)."""

    def __init__(self, path: Path | str, gpus: list[Gpu] | None = None, mode: str = "ok") -> None:
        self.path = Path(path)
        self.gpus = idle_gpus(1) if gpus is None else gpus
        self.mode = mode
        self.save()

    def save(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown nvidia-smi stand-in mode {self.mode!r}; use one of {MODES}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps({"mode": self.mode, "gpus": [asdict(gpu) for gpu in self.gpus]}, indent=1))
        os.replace(tmp, self.path)

    def set_mode(self, mode: str) -> None:
        self.mode = mode
        self.save()

    def set_load(self, index: int, *, memory_used_mib: int | None = None, utilization_pct: int | None = None,
                 apps: list[GpuApp] | None = None) -> None:
        """Change one GPU's memory use, utilization and/or compute apps."""
        gpu = next(gpu for gpu in self.gpus if gpu.index == index)
        if memory_used_mib is not None:
            gpu.memory_used_mib = memory_used_mib
        if utilization_pct is not None:
            gpu.utilization_pct = utilization_pct
        if apps is not None:
            gpu.apps = apps
        self.save()

    def env(self) -> dict[str, str]:
        """The environment that points the stand-in at this file."""
        return {STATE_ENV: str(self.path)}
