"""bench/gpu_profile_run.py's trace arithmetic: what it says about idle GPU time and per-stream shares must be
right, or the MFU levers it points at are wrong."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SPEC = importlib.util.spec_from_file_location("gpu_profile_run", Path(__file__).parents[1] / "bench/gpu_profile_run.py")
profile_run = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(profile_run)


def kernel(name: str, ts: float, dur: float, stream: int) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_overlapping_streams_count_once_in_busy_time_and_gaps_are_idle():
    events = [
        kernel("sm90_xmma_gemm_bf16bf16_bf16f32", 0, 1000, 7),  # target stream: a matmul 0..1 ms
        kernel("triton_per_fused_add_rms_norm_3", 1000, 200, 7),
        kernel("flex_attention_backward", 500, 1000, 13),  # drafter stream overlaps 0.5..1.5 ms
        kernel("multi_tensor_apply_kernel", 2500, 500, 13),  # after a 1 ms gap
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000},  # host side: ignored
    ]
    got = profile_run.summarise(events, samples=2, flops_per_sample=1e9)
    assert got["span_ms"] == 1.5  # 3 ms span over 2 samples
    assert got["busy_ms"] == 1.0  # 0..1.5 and 2.5..3.0 = 2 ms of 3
    assert got["idle_ms"] == 0.5
    assert got["kernel_sum_ms"] == 1.35  # 2.7 ms of kernels: the overlap counted in each stream
    assert got["gaps_ms"] == [1.0]
    assert got["streams"]["7"] == {"matmul": 0.5, "reduction": 0.1, "total": 0.6}
    assert got["streams"]["13"] == {"attention": 0.5, "optimizer": 0.25, "total": 0.75}
    assert dict(got["top"]) == {"sm90_xmma_gemm_bf16bf16_bf16f32": 0.5, "flex_attention_backward": 0.5,
                                "multi_tensor_apply_kernel": 0.25, "triton_per_fused_add_rms_norm_3": 0.1}


def test_kernel_names_fall_into_the_categories_a_reader_expects():
    assert profile_run.category("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT") == "matmul"
    assert profile_run.category("pytorch_flash::flash_fwd_kernel") == "attention"
    assert profile_run.category("triton_tem_fused_flex_attention_0") == "attention"
    assert profile_run.category("void at::native::(anonymous namespace)::multi_tensor_apply_kernel") == "optimizer"
    assert profile_run.category("Memcpy DtoD (Device -> Device)") == "copy"
    assert profile_run.category("triton_poi_fused__to_copy_mul_silu_5") == "elementwise"
    assert profile_run.category("mystery") == "other"


def test_a_trace_without_device_events_says_so():
    assert "no device events" in profile_run.summarise([], samples=1, flops_per_sample=1.0)["error"]
