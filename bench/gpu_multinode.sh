#!/usr/bin/env bash
# Issue 15: a 2-node procsplit run against 1 node, on a 2-GPU machine (e.g. nvidia-h200-x2), ~5 min.
# Two "nodes" are two trainer invocations on this host, each pinned to its own GPU (CUDA_VISIBLE_DEVICES),
# meeting at 127.0.0.1 through the trainer's TCPStore rendezvous; gradients go over NCCL between them.
#   1 node : CUDA_VISIBLE_DEVICES=0, --nnodes 1                (one drafter rank, one target)
#   2 nodes: node 0 on GPU 0, node 1 on GPU 1, --nnodes 2       (two drafter ranks, a target each)
# Prints the steady tok/s of each (median of the `phase=train` step lines after the first quarter of
# them; the 2-node figure is node 0's, which is the whole run's) and the ratio. Everything lands under
# $OUT as it comes (logs, summary.txt). Usage: bash bench/gpu_multinode.sh [--qwen]  (--qwen: the
# qwen3-8b-shape preset instead of h200-small; its compile takes longer, so give it ONE_S/TWO_S ~240).
# Environment: ONE_S / TWO_S seconds per phase (default 110 / 150), VARIANT (default nographs), PORT,
# PRESET, DEVICE (see below), PYTHON.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
PRESET=${PRESET:-h200-small}; [[ ${1:-} == --qwen ]] && PRESET=qwen3-8b-shape
DEVICE=${DEVICE:-cuda:0}  # DEVICE=cpu PRESET=tiny-cpu VARIANT=eager ONE_S=20 TWO_S=25: a dry run without GPUs
VARIANT=${VARIANT:-nographs}; PORT=${PORT:-29531}
PY=${PYTHON:-python3}
common=(--preset "$PRESET" --variant "$VARIANT" --topology procsplit --targets "$DEVICE" --drafters "$DEVICE"
        --steps 1000000 --wandb off --out /tmp/mn-runs)

node() {  # node NAME GPU SECONDS ARGS...: one trainer invocation, its log in $OUT/NAME.log
    local name=$1 gpu=$2 secs=$3; shift 3
    CUDA_VISIBLE_DEVICES=$gpu TORCHINDUCTOR_CACHE_DIR=/tmp/ind-mn-$gpu timeout -s TERM "$secs" \
        "$PY" -m trainer "${common[@]}" --run-name "$name" "$@" >"$OUT/$name.log" 2>"$OUT/$name.err"
    echo "$name rc=$?" | tee -a "$OUT/rc.txt"
}

steady() {  # steady LOG: median tok/s of the train step lines after the first quarter
    "$PY" - "$1" <<'PY'
import re, statistics, sys
rates = [float(m.group(1)) for line in open(sys.argv[1]) if "event=step" in line and "phase=train" in line
         for m in [re.search(r" tok_s=([\d.]+)", line)] if m]
kept = rates[len(rates) // 4:]
print(f"{statistics.median(kept):.1f} {len(kept)}" if kept else "nan 0")
PY
}

nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader >"$OUT/gpu.txt" 2>&1
echo "preset=$PRESET variant=$VARIANT" | tee "$OUT/summary.txt"

node one 0 "${ONE_S:-110}"
read -r one one_n < <(steady "$OUT/one.log")
echo "1 node : $one tok/s (median of $one_n step lines)" | tee -a "$OUT/summary.txt"

mn=(--nnodes 2 --master-addr 127.0.0.1 --master-port "$PORT" --set run.rendezvous_timeout_s=60)
node two-n1 1 "${TWO_S:-150}" "${mn[@]}" --node-rank 1 &
node two-n0 0 "${TWO_S:-150}" "${mn[@]}" --node-rank 0
wait
read -r two two_n < <(steady "$OUT/two-n0.log")
read -r two1 _ < <(steady "$OUT/two-n1.log")
echo "2 nodes: $two tok/s (node 0, median of $two_n step lines; node 1 reports $two1)" | tee -a "$OUT/summary.txt"
grep -h "event=done\|event=error" "$OUT"/two-n*.log | tee -a "$OUT/summary.txt"
"$PY" -c "import sys; a, b = float(sys.argv[1]), float(sys.argv[2]); print(f'2 nodes / 1 node: {b / a:.2f}x')" \
    "$one" "$two" 2>/dev/null | tee -a "$OUT/summary.txt"
