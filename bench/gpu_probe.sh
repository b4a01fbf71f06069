#!/usr/bin/env bash
# Issue 16's probe, one call on nvidia-h200-x2 (~9 min), every result written under $OUT as it comes:
#   GPU 0: bench/gpu_probe.py --part target (eager vs compiled layers), then the trainer's qwen3-8b-shape
#          threads nographs with drafter.compile_scope=layers and target.compile=layers;
#   GPU 1: bench/gpu_probe.py --part drafter, scope layers then scope whole (today's default).
# Each process has its own inductor cache directory, so every compile figure is a cold one.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
run() {  # run NAME GPU SECONDS CMD...: one cold-cache process, output in $OUT/NAME.log
    local name=$1 gpu=$2 secs=$3; shift 3
    CUDA_VISIBLE_DEVICES=$gpu TORCHINDUCTOR_CACHE_DIR=/tmp/ind-$name timeout -s TERM "$secs" "$@" \
        >"$OUT/$name.log" 2>&1
    echo "$name rc=$? cache=$(du -sm /tmp/ind-$name 2>/dev/null | cut -f1)MB" | tee -a "$OUT/rc.txt"
}
(
    run target 0 150 python3 bench/gpu_probe.py --out "$OUT/p-target" --part target
    run thr-layers 0 "${THR_S:-330}" python3 -m trainer --preset qwen3-8b-shape --variant nographs \
        --steps 1000000 --wandb off --run-name thr-layers --out /tmp/qruns \
        --set drafter.compile_scope=layers --set target.compile=layers
) &
(
    run d-layers 1 220 python3 bench/gpu_probe.py --out "$OUT/p-layers" --part drafter --mode layers
    run d-whole 1 "${WHOLE_S:-260}" python3 bench/gpu_probe.py --out "$OUT/p-whole" --part drafter --mode whole
) &
wait
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$OUT/gpu.txt" 2>&1
