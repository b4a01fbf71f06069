#!/usr/bin/env bash
# Every trainer figure of docs/benchmarks.md, re-measured in as few device calls as fit (each under the
# device tool's 10-minute limit), on a 2-GPU H200 machine (nvidia-h200-x2), from the repository root with
# dfo's missing wheels carried in .whl/ (see the device tool's README):
#     bash bench/gpu_all.sh qwen     # qwen3-8b-shape: threads nographs + procsplit trees (1 GPU, cold), then
#                                    # procsplit trees on 2 GPUs (bench/gpu_qwen.sh; ~9 min)
#     bash bench/gpu_all.sh small    # h200-small 1 vs 2 GPUs, both topologies (bench/gpu_multi.sh; ~5 min)
#     bash bench/gpu_all.sh e2e      # dfo end to end (bench/gpu_dfo_e2e.sh --procsplit) on GPU 0 while GPU 1
#                                    # re-measures qwen3-8b-shape threads nographs alone (~6 min)
# Everything lands in $OUT as it is measured (a call that runs out of time still returns what it has);
# summary.md there holds the tables (bench/qwen_summary.py), with the commit measured. Then
# `python bench/stale.py` here says which rows of docs/benchmarks.md the new figures replace.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:$PWD || exit 1
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 OUT
case "${1:-}" in
    qwen) bash bench/gpu_qwen.sh "${QWEN_P1:-290}" "${QWEN_P2:-235}" ;;
    small) GPU_MULTI_BUDGET=${GPU_MULTI_BUDGET:-280} timeout 330 bash bench/gpu_multi.sh ;;
    e2e)
        mkdir -p "$OUT/qwen"
        ( CUDA_VISIBLE_DEVICES=1 timeout -s TERM "${QWEN_S:-300}" python3 -m trainer --preset qwen3-8b-shape \
              --variant nographs --steps 1000000 --wandb off --run-name thr-nographs-1g --out /tmp/qruns \
              >"$OUT/qwen/thr-nographs-1g.log" 2>&1 ) &
        CUDA_VISIBLE_DEVICES=0 CHAIN_TIMEOUT=${CHAIN_TIMEOUT:-150} E2E_EXTRA=--force timeout 320 \
            bash bench/gpu_dfo_e2e.sh --procsplit 2>&1 | tee "$OUT/e2e.txt"
        wait
        python3 bench/qwen_summary.py "$OUT"/qwen/*.log | tee "$OUT/summary.md" ;;
    *) echo "usage: bash bench/gpu_all.sh qwen|small|e2e" >&2; exit 2 ;;
esac
