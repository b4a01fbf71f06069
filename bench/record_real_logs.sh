#!/usr/bin/env bash
# Record a corpus of real trainer logs for the decision rules (tests/data/real/), on a 2-GPU H200 machine
# (device kind nvidia-h200-x2), from the repository root:
#     bash bench/record_real_logs.sh [WAVE_SECONDS]
# Three waves of concurrent runs, each run `python -m trainer ... > LOG 2>&1` under `timeout -s TERM`
# (so it ends with the trainer's checkpointed stop, exit 75). Runs of a wave share the host (CPUs, and
# some a GPU): that is part of what the corpus must show. Each wave's logs, its commands and the host's
# facts are packed into $OUT/waveN.tgz as soon as the wave ends, so a call that runs out of time still
# returns the waves it finished. CPU runs are pinned to 4 cores each with taskset.
set -uo pipefail
cd "$(dirname "$0")/.."
WAVE_S=${1:-185}
OUT=${OUT:-out}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p "$OUT"
W=/tmp/rec
rm -rf "$W"; mkdir -p "$W"

# start NAME GPUS CPUSET -- trainer args...   (GPUS: CUDA_VISIBLE_DEVICES, "" = none; CPUSET: taskset list or "")
start() {
    local name=$1 gpus=$2 cpus=$3; shift 4
    local dir=$W/$WAVE pin=()
    [[ -n $cpus ]] && pin=(taskset -c "$cpus")
    echo "$name: CUDA_VISIBLE_DEVICES=$gpus ${pin[*]} python3 -m trainer $* --run-name $name --wandb off --out $W/runs" >>"$dir/COMMANDS.txt"
    ( export CUDA_VISIBLE_DEVICES=$gpus
      [[ -n $cpus ]] && export OMP_NUM_THREADS=4
      "${pin[@]}" timeout -s TERM "$WAVE_S" python3 -m trainer "$@" --run-name "$name" --wandb off --out "$W/runs" \
          >"$dir/$name.log" 2>&1
      echo "exit=$?" >"$dir/$name.exit" ) &
}

wave() {
    WAVE=$1
    mkdir -p "$W/$WAVE"
    { date -u +%FT%TZ; nproc; nvidia-smi -L; python3 -c 'import torch; print(torch.__version__)'; } >"$W/$WAVE/HOST.txt" 2>&1
}

finish() {
    wait
    nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader >>"$W/$WAVE/HOST.txt" 2>&1
    tar czf "$OUT/$WAVE.tgz" -C "$W" "$WAVE"
    echo "== $WAVE done $(date -u +%T)"; tail -qn 1 "$W/$WAVE"/*.log | cut -c1-160
}

BIG=10000000
wave wave1
start qwen-ps-eager-g0 0 "" -- --preset qwen3-8b-shape --variant eager --topology procsplit --drafters cuda:0 --steps $BIG
start small-thr-nographs-g1 1 "" -- --preset h200-small --variant nographs --steps $BIG
start small-ps-eager-g1shared 1 "" -- --preset h200-small --variant eager --topology procsplit --drafters cuda:0 --steps $BIG
start tiny-thr-nographs-cpu "" 0-3 -- --preset tiny-cpu --variant nographs --steps $BIG
start tiny-ps2-eager-cpu "" 4-7 -- --preset tiny-cpu --variant eager --topology procsplit --drafters cpu,cpu --steps $BIG
start tiny-thr-trees-cpu "" 8-11 -- --preset tiny-cpu --variant trees --steps $BIG
finish

wave wave2
start qwen-thr-eager-g0 0 "" -- --preset qwen3-8b-shape --variant eager --steps $BIG
start small-ps-trees-2g 0,1 "" -- --preset h200-small --variant trees --topology procsplit --targets cuda:0 --drafters cuda:0,cuda:1 --steps $BIG
start small-thr-localtls-g1 1 "" -- --preset h200-small --variant localtls --steps $BIG
start small-ps-notrees-g1 1 "" -- --preset h200-small --variant notrees --topology procsplit --drafters cuda:0 --steps $BIG
start tiny-thr-notrees-cpu "" 0-3 -- --preset tiny-cpu --variant notrees --steps $BIG
start tiny-thr-localtls-cpu "" 4-7 -- --preset tiny-cpu --variant localtls --steps $BIG
start tiny-thr-eager-cpu "" 8-11 -- --preset tiny-cpu --variant eager --steps $BIG
finish

wave wave3
start qwen-ps-eager-2g 0,1 "" -- --preset qwen3-8b-shape --variant eager --topology procsplit --targets cuda:0,cuda:1 --drafters cuda:0,cuda:1 --steps $BIG
start small-thr-eager-2g 0,1 "" -- --preset h200-small --variant eager --targets cuda:0 --drafters cuda:0,cuda:1 --steps $BIG
start small-ps-eager-g1 1 "" -- --preset h200-small --variant eager --topology procsplit --drafters cuda:0 --steps $BIG
start tiny-ps-nographs-cpu "" 0-3 -- --preset tiny-cpu --variant nographs --topology procsplit --steps $BIG
# a CPU run that another job joins after 70 s on the same 2 cores (a level shift on a shared host)
start tiny-thr-eager-shift "" 12,13 -- --preset tiny-cpu --variant eager --steps $BIG
( sleep 70; timeout $((WAVE_S - 75)) taskset -c 12,13 python3 -c 'while True: pass' & \
  timeout $((WAVE_S - 75)) taskset -c 12,13 python3 -c 'while True: pass'; wait ) &
echo "tiny-thr-eager-shift: two busy-loop processes pinned to its cores 12,13 from t=70 s to t=$((WAVE_S - 5)) s" >>"$W/wave3/COMMANDS.txt"
finish
