#!/usr/bin/env bash
# The whole GPU session of this repository in one device call on a 2-GPU H200 machine (nvidia-h200-x2), from
# the repository root with dfo's missing wheels carried in .whl/:
#   phase A, in parallel: dfo end to end on GPU 0 (bench/gpu_dfo_e2e.sh --procsplit) and the trainer's
#            strategy/topology comparison on GPU 1 (bench/gpu_variants.py, seen as cuda:0 there);
#   phase B: the multi-GPU cases on both GPUs (bench/gpu_multi.sh).
# $OUT gets e2e.tgz, variants.tgz, and gpu_multi.sh's files; stdout has the summaries.
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || exit 1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 OUT=${OUT:-out}
mkdir -p "$OUT" /tmp/v
nvidia-smi -L
( CUDA_VISIBLE_DEVICES=1 timeout 280 python3 bench/gpu_variants.py --out /tmp/v --budget 150 --timeout 45 \
    --qwen-timeout 100 --matrix h200-small:procsplit:trees,eager --matrix h200-small:threads:nographs,eager \
    --matrix qwen3-8b-shape:procsplit:trees --matrix qwen3-8b-shape:threads:nographs >/tmp/v/stdout.txt 2>&1 ) &
CUDA_VISIBLE_DEVICES=0 CHAIN_TIMEOUT=130 E2E_EXTRA=--force timeout 290 bash bench/gpu_dfo_e2e.sh --procsplit
wait
echo "== variants"; cat /tmp/v/results.md; tail -5 /tmp/v/stdout.txt
tar czf "$OUT/variants.tgz" -C /tmp v
echo "== multi"
GPU_MULTI_BUDGET=${GPU_MULTI_BUDGET:-210} timeout 260 bash bench/gpu_multi.sh
