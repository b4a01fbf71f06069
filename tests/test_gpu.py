"""nvidia-smi handling: parsing, every error kind, and a hung driver, through the stand-in nvidia-smi."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from harness import STANDIN_BIN
from harness.nvidia_smi import STATE_ENV, Gpu, GpuApp, NvidiaSmiState
from orchestrator import gpu
from orchestrator.remote.local import LocalTarget


@pytest.fixture
def smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> NvidiaSmiState:
    """The stand-in on PATH with two idle H200s; tests change its state."""
    monkeypatch.setenv("PATH", f"{STANDIN_BIN}:{os.environ['PATH']}")
    monkeypatch.setenv(STATE_ENV, str(tmp_path / "smi.json"))
    return NvidiaSmiState(tmp_path / "smi.json", gpus=[Gpu(0), Gpu(1)])


def test_parse_gpus_handles_missing_values() -> None:
    rows = gpu.parse_gpus("0, NVIDIA H200, 0, 143771, 0\n1, NVIDIA H200, [N/A], 143771, [Not Supported]\n")
    assert rows == [gpu.Gpu(0, "NVIDIA H200", 0, 143771, 0), gpu.Gpu(1, "NVIDIA H200", None, 143771, None)]


def test_parse_rejects_lines_that_are_not_rows() -> None:
    with pytest.raises(gpu.NvidiaSmiError) as caught:
        gpu.parse_gpus("No devices were found\n")
    assert caught.value.kind == "unparsable"


def test_query_gpus_reads_every_gpu(smi: NvidiaSmiState) -> None:
    smi.set_load(1, memory_used_mib=30000, utilization_pct=97)
    gpus = gpu.query_gpus(LocalTarget(), timeout=10)
    assert [(g.index, g.name, g.mem_used_mib, g.mem_total_mib, g.util_pct) for g in gpus] == [
        (0, "NVIDIA H200", 0, 143771, 0),
        (1, "NVIDIA H200", 30000, 143771, 97),
    ]


def test_query_compute_apps_lists_processes(smi: NvidiaSmiState) -> None:
    assert gpu.query_compute_apps(LocalTarget(), timeout=10) == []
    smi.set_load(0, apps=[GpuApp(pid=4242, used_memory_mib=2048)])
    (app,) = gpu.query_compute_apps(LocalTarget(), timeout=10)
    assert (app.pid, app.process_name, app.used_memory_mib) == (4242, "python", 2048)


@pytest.mark.parametrize(
    "mode, kind, words",
    [("no_devices", "no_devices", "found no GPU"), ("no_driver", "no_driver", "driver"), ("mismatch", "mismatch", "mismatch")],
)
def test_failures_map_to_kinds_with_a_fix(smi: NvidiaSmiState, mode: str, kind: str, words: str) -> None:
    smi.set_mode(mode)
    with pytest.raises(gpu.NvidiaSmiError, match=words) as caught:
        gpu.query_gpus(LocalTarget("ct9"), timeout=10)
    assert caught.value.kind == kind
    assert str(caught.value).startswith("ct9: ")


def test_missing_nvidia_smi(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no nvidia-smi on this GPU-less machine
    with pytest.raises(gpu.NvidiaSmiError, match="not found") as caught:
        gpu.query_gpus(LocalTarget(), timeout=10)
    assert caught.value.kind == "missing"


def test_hung_nvidia_smi_comes_back_as_timeout_within_the_timeout(smi: NvidiaSmiState) -> None:
    smi.set_mode("hang")
    started = time.monotonic()
    with pytest.raises(gpu.NvidiaSmiError, match="did not answer within 1s") as caught:
        gpu.query_gpus(LocalTarget(), timeout=1)
    assert caught.value.kind == "timeout"
    assert time.monotonic() - started < 5


def test_sampler_command_line() -> None:
    assert gpu.sampler_argv(1000) == [
        "nvidia-smi",
        "--query-gpu=index,memory.used,memory.total,utilization.gpu",
        "--format=csv,noheader,nounits",
        "-lms",
        "1000",
    ]
