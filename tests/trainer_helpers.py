"""Helpers for the trainer tests: run `python -m trainer` as a subprocess and read its metric lines."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from orchestrator.logfmt import EventRecord, StepRecord, parse_logfmt

REPO = Path(__file__).resolve().parents[1]


def trainer_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("WANDB_API_KEY", None)
    return env


def trainer_cmd(out: Path, run_name: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "trainer", "--preset", "tiny-cpu", "--wandb", "off", "--out", str(out),
            "--run-name", run_name, *args]


@dataclass
class TrainerRun:
    code: int
    stdout: str
    stderr: str

    @property
    def records(self) -> list:
        return [parse_logfmt(line) for line in self.stdout.splitlines()]

    @property
    def steps(self) -> list[StepRecord]:
        return [r for r in self.records if isinstance(r, StepRecord)]

    def events(self, name: str) -> list[EventRecord]:
        return [r for r in self.records if isinstance(r, EventRecord) and r.event == name]


def run_trainer(out: Path, run_name: str, *args: str, timeout: float = 120) -> TrainerRun:
    proc = subprocess.run(trainer_cmd(out, run_name, *args), capture_output=True, text=True, timeout=timeout,
                          env=trainer_env(), cwd=out)
    return TrainerRun(proc.returncode, proc.stdout, proc.stderr)
