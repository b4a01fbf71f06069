#!/usr/bin/env bash
# qwen3-8b-shape on a 2-GPU H200 machine (device kind nvidia-h200-x2) in one call, from the repository root:
#     bash bench/gpu_qwen.sh [PHASE1_S] [PHASE2_S]
# phase 1, in parallel on cold compile caches:
#   GPU0: threads nographs, 1 GPU (all thread stacks dumped to the log at 100 s and 200 s: where it waits);
#   GPU1: procsplit trees, 1 GPU;
# phase 2, both GPUs, caches now warm: procsplit trees with targets and drafters on cuda:0,cuda:1.
# Each log goes to $OUT as it is written; bench/qwen_summary.py prints the table (steady tok/s = median of
# the second half of the step lines, MFU against 989 TFLOP/s, first step after start, compile seconds).
set -uo pipefail
cd "$(dirname "$0")/.."
P1=${1:-300}; P2=${2:-220}
OUT=${OUT:-out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
git_rev=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
echo "commit $git_rev; $(nvidia-smi -L | wc -l) GPUs" | tee "$OUT/meta.txt"
DUMP='import faulthandler, signal, runpy, sys; faulthandler.register(signal.SIGUSR1, all_threads=True); sys.argv[0] = "trainer"; runpy.run_module("trainer", run_name="__main__")'

run() {  # run NAME GPUS SECONDS args...
    local name=$1 gpus=$2 secs=$3; shift 3
    echo "$name: CUDA_VISIBLE_DEVICES=$gpus python3 -m trainer --preset qwen3-8b-shape $* --steps 1000000 --wandb off" >>"$OUT/meta.txt"
    CUDA_VISIBLE_DEVICES=$gpus timeout -s TERM "$secs" python3 -c "$DUMP" --preset qwen3-8b-shape "$@" \
        --steps 1000000 --wandb off --run-name "$name" --out /tmp/qruns >"$OUT/$name.log" 2>&1
}

run thr-nographs-1g 0 "$P1" --variant nographs &
pid=$!
( sleep 100; pkill -USR1 -f "^python3 -c import faulthandler.*run-name thr-nographs-1g" ; sleep 100; pkill -USR1 -f "^python3 -c import faulthandler.*run-name thr-nographs-1g" ) &
run ps-trees-1g 1 "$P1" --variant trees --topology procsplit &
wait $pid; wait
python3 bench/qwen_summary.py "$OUT"/*.log | tee "$OUT/summary.md"
run ps-trees-2g 0,1 "$P2" --variant trees --topology procsplit --targets cuda:0,cuda:1 --drafters cuda:0,cuda:1
python3 bench/qwen_summary.py "$OUT"/*.log | tee "$OUT/summary.md"
