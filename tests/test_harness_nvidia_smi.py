"""The nvidia-smi stand-in reproduces the real tool's formats, error texts and exit codes (docs/design.md)."""

from __future__ import annotations

import subprocess
import time

import pytest

from harness.nvidia_smi import STANDIN, Gpu, GpuApp, NvidiaSmiState, idle_gpus


@pytest.fixture
def smi_state(tmp_path) -> NvidiaSmiState:
    return NvidiaSmiState(tmp_path / "smi.json", idle_gpus(2))


def smi(state: NvidiaSmiState, *args: str, timeout: float = 10) -> subprocess.CompletedProcess:
    return subprocess.run([str(STANDIN), *args], capture_output=True, text=True, timeout=timeout, env=state.env())


def test_query_gpu_noheader_nounits_matches_real_format(smi_state):
    smi_state.set_load(1, memory_used_mib=80000, utilization_pct=97)
    out = smi(smi_state, "--query-gpu=index,memory.used,memory.total,utilization.gpu", "--format=csv,noheader,nounits")
    assert out.returncode == 0
    assert out.stdout == "0, 0, 143771, 0\n1, 80000, 143771, 97\n"


def test_query_gpu_with_header_and_units(smi_state):
    out = smi(smi_state, "--query-gpu=index,name,memory.used,utilization.gpu,power.draw", "--format=csv")
    assert out.stdout.splitlines() == [
        "index, name, memory.used [MiB], utilization.gpu [%], power.draw [W]",
        "0, NVIDIA H200, 0 MiB, 0 %, 74.25 W",
        "1, NVIDIA H200, 0 MiB, 0 %, 74.25 W",
    ]


def test_missing_values_print_na_and_not_supported(tmp_path):
    state = NvidiaSmiState(tmp_path / "s.json", [Gpu(0, memory_used_mib=None, utilization_pct="[Not Supported]")])
    out = smi(state, "--query-gpu=memory.used,utilization.gpu", "--format=csv,noheader")
    assert out.stdout == "[N/A], [Not Supported]\n"


def test_compute_apps_listed_per_gpu_and_empty_when_none(smi_state):
    assert smi(smi_state, "--query-compute-apps=pid,used_memory,gpu_uuid", "--format=csv,noheader").stdout == ""
    smi_state.set_load(1, apps=[GpuApp(4242, 1024)])
    out = smi(smi_state, "--query-compute-apps=pid,used_memory,gpu_uuid", "--format=csv,noheader,nounits")
    assert out.stdout == f"4242, 1024, {smi_state.gpus[1].uuid}\n"


def test_list_and_select_by_index(smi_state):
    assert smi(smi_state, "-L").stdout.startswith("GPU 0: NVIDIA H200 (UUID: GPU-")
    out = smi(smi_state, "-i", "1", "--query-gpu=index", "--format=csv,noheader")
    assert out.stdout == "1\n"
    assert smi(smi_state, "-i", "7", "--query-gpu=index", "--format=csv").returncode == 6


@pytest.mark.parametrize(
    "mode, text, code",
    [
        ("no_devices", "No devices were found", 6),
        ("no_driver", "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.", 9),
        ("mismatch", "Failed to initialize NVML: Driver/library version mismatch", 18),
    ],
)
def test_error_modes_print_real_text_on_stdout_with_real_exit_code(smi_state, mode, text, code):
    smi_state.set_mode(mode)
    out = smi(smi_state, "--query-gpu=index", "--format=csv")
    assert (out.returncode, out.stderr) == (code, "")
    assert out.stdout.startswith(text)


def test_hang_mode_never_returns(smi_state):
    smi_state.set_mode("hang")
    with pytest.raises(subprocess.TimeoutExpired):
        smi(smi_state, "-L", timeout=0.5)


def test_unknown_field_is_rejected(smi_state):
    out = smi(smi_state, "--query-gpu=index,bogus", "--format=csv")
    assert out.returncode == 2 and 'Field "bogus" is not a valid field to query.' in out.stdout


def test_loop_rereads_state_each_tick(smi_state):
    proc = subprocess.Popen([str(STANDIN), "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-lms", "50"],
                            stdout=subprocess.PIPE, text=True, env=smi_state.env())
    try:
        assert proc.stdout.readline() == "0\n"
        smi_state.set_load(0, utilization_pct=88)
        deadline = time.monotonic() + 5
        while proc.stdout.readline() != "88\n":
            assert time.monotonic() < deadline
    finally:
        proc.kill()
        proc.wait()
