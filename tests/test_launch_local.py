"""The embedded default on a fresh machine: `dfo launch --host here --variant eager` runs the real tiny-cpu
trainer locally (no SSH, no pct), the same way as in a container; `dfo runs/logs/stop` then work on it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

DFO = str(Path(sys.executable).parent / "dfo")
HAS_TRAINER = (Path(__file__).resolve().parents[1] / "trainer" / "__main__.py").exists()

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not HAS_TRAINER, reason="trainer/__main__.py is not there yet")]


@pytest.mark.timeout(480)
def test_fresh_machine_launches_the_tiny_cpu_trainer_here(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("DFO_INVENTORY", "XDG_STATE_HOME")}
    env.update(HOME=str(tmp_path / "home"), DFO_HOME=str(tmp_path / "state"))

    def dfo(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([DFO, *args], capture_output=True, text=True, timeout=120, env=env)

    # eager rather than the README's nographs: the same launch path without minutes of cold torch.compile on CPU
    launched = dfo("launch", "--host", "here", "--variant", "eager", "--set", "steps=100000", "--set", "log_every=1", "--json")
    assert launched.returncode == 0, launched.stderr
    info = json.loads(launched.stdout)
    assert re.fullmatch(r"train_eager_\d{8}-\d{4}", info["run"]) and info["pushed"] is True
    try:
        log = Path(info["log"])
        assert log.parent == tmp_path / "home" / "dfo-workspace" / "logs"
        deadline = time.monotonic() + 240  # a step within seconds on an idle machine; minutes under a full test run
        while "event=step" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert "event=step" in log.read_text(), f"load {os.getloadavg()}\n{log.read_text()[-2000:]}"
        assert [r["state"] for r in json.loads(dfo("runs", "--json").stdout)] == ["running"]
        assert "event=step" in dfo("logs", info["run"], "-n", "5").stdout
    finally:
        stopped = dfo("stop", info["run"], "--grace", "30", "--json")
    assert stopped.returncode == 0 and json.loads(stopped.stdout)["state"] == "stopped", f"{stopped.stderr}\n{log.read_text()[-2000:]}"
    assert json.loads(stopped.stdout)["exit_code"] == 75  # the trainer's own "stopped by SIGTERM" status
