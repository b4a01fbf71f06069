#!/usr/bin/env bash
# Every trainer figure of docs/benchmarks.md, re-measured in as few device calls as fit (each under the
# device tool's 10-minute limit), on a 2-GPU H200 machine (nvidia-h200-x2), from the repository root with
# dfo's missing wheels carried in .whl/ (see the device tool's README):
#     bash bench/gpu_all.sh qwen     # qwen3-8b-shape: threads nographs + procsplit trees (1 GPU, cold), then
#                                    # procsplit trees on 2 GPUs (bench/gpu_qwen.sh; ~9 min)
#     bash bench/gpu_all.sh small    # h200-small 1 vs 2 GPUs, both topologies (bench/gpu_multi.sh; ~5 min)
#     bash bench/gpu_all.sh regional # qwen3-8b-shape procsplit, regional compile: 1 GPU on each GPU, then 2
#                                    # GPUs as one run, then the compile of one layer / the head alone (~10 min)
#     bash bench/gpu_all.sh e2e      # dfo end to end (bench/gpu_dfo_e2e.sh --procsplit) on GPU 0 while GPU 1
#                                    # compiles one drafter layer alone; then h200-small 1 vs 2 nodes (~9 min)
#     bash bench/gpu_all.sh current  # the rows of "Trainer figures on today's code": qwen3-8b-shape threads,
#                                    # every strategy cold, two at a time (GPU 0: nographs, notrees; GPU 1:
#                                    # trees, eager), then procsplit 1 GPU on each GPU vs 2 GPUs (~9 min)
#     bash bench/gpu_all.sh current1 # one GPU (nvidia-h200), when no 2-GPU kind is lent: the same strategies
#                                    # cold one after another (nographs, trees, notrees ~95 s, eager ~60 s; ~9 min)
#     bash bench/gpu_all.sh single1  # one GPU: qwen3-8b-shape procsplit 1 GPU, h200-small procsplit eager 1 GPU,
#                                    # then a profile of the threads trees run (bench/gpu_profile_run.py) (~5 min)
#     bash bench/gpu_all.sh scaling  # qwen3-8b-shape procsplit on 2 GPUs to its SIGTERM (the done line's
#                                    # replica hashes), h200-small 1 vs 2 nodes (bench/gpu_multinode.sh), then
#                                    # h200-small procsplit eager 1 vs 2 GPUs; logs also in logs.tgz (~9 min)
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
    qwen) bash bench/gpu_qwen.sh "${QWEN_P1:-290}" "${QWEN_P2:-235}" ;;  # history: whole-scope figures
    small) GPU_MULTI_BUDGET=${GPU_MULTI_BUDGET:-280} timeout 330 bash bench/gpu_multi.sh ;;
    regional) timeout 590 bash bench/gpu_probe.sh scale ;;
    current)
        export SIG=${SIG:-KILL} NOGRAPHS_S=${NOGRAPHS_S:-110} GRAPHS_S=${GRAPHS_S:-110} EAGER_S=${EAGER_S:-70}
        GPU=0 STRATEGIES="nographs notrees" bash bench/gpu_probe.sh cold >"$OUT/cold-gpu0.txt" 2>&1 &
        GPU=1 STRATEGIES="trees eager" bash bench/gpu_probe.sh cold >"$OUT/cold-gpu1.txt" 2>&1 &
        wait
        python3 bench/qwen_summary.py "$OUT"/cold-*.log | tee "$OUT/summary-cold.md"
        PIECES=0 P1_S=${P1_S:-150} P2_S=${P2_S:-160} bash bench/gpu_probe.sh scale ;;
    current1)
        export SIG=${SIG:-KILL} NOGRAPHS_S=${NOGRAPHS_S:-95} GRAPHS_S=${GRAPHS_S:-95} EAGER_S=${EAGER_S:-60}
        STRATEGIES=${STRATEGIES:-nographs trees notrees eager} bash bench/gpu_probe.sh cold >"$OUT/cold.txt" 2>&1
        python3 bench/qwen_summary.py "$OUT"/cold-*.log | tee "$OUT/summary-cold.md" ;;
    single1)
        Q=(python3 -m trainer --preset qwen3-8b-shape --variant nographs --topology procsplit --steps 1000000
           --wandb off --out /tmp/qruns --targets cuda:0 --drafters cuda:0 --run-name ps-1g)
        TORCHINDUCTOR_CACHE_DIR=/tmp/ind-ps1 timeout -s TERM "${P1_S:-130}" "${Q[@]}" >"$OUT/ps-1g.log" 2>&1
        echo "ps-1g rc=$?" >>"$OUT/rc.txt"
        S=(python3 -m trainer --preset h200-small --variant eager --topology procsplit --steps 1000000 --wandb off
           --out /tmp/sruns --run-name small-1g --targets cuda:0 --drafters cuda:0)
        timeout -s TERM "${S1_S:-55}" "${S[@]}" >"$OUT/small-1g.log" 2>&1
        echo "small-1g rc=$?" >>"$OUT/rc.txt"
        { python3 bench/qwen_summary.py "$OUT"/ps-1g.log; python3 bench/qwen_summary.py --preset h200-small "$OUT"/small-1g.log; } \
            | tee "$OUT/summary.md"
        TORCHINDUCTOR_CACHE_DIR=/tmp/ind-prof timeout "${PROF_S:-150}" python3 bench/gpu_profile_run.py --out "$OUT/prof-trees" \
            --variant trees >"$OUT/prof-trees.log" 2>&1
        echo "prof-trees rc=$?" >>"$OUT/rc.txt"; rm -rf "$OUT/prof-trees/runs" "$OUT/prof-trees/trace.json.gz" ;;
    scaling)
        Q=(python3 -m trainer --preset qwen3-8b-shape --variant nographs --topology procsplit --steps 1000000
           --wandb off --out /tmp/qruns --targets cuda:0,cuda:1 --drafters cuda:0,cuda:1 --run-name ps-2g-term)
        TORCHINDUCTOR_CACHE_DIR=/tmp/ind-q timeout -s TERM "${Q2_S:-170}" "${Q[@]}" >"$OUT/ps-2g-term.log" 2>&1
        echo "ps-2g-term rc=$?" >>"$OUT/rc.txt"
        python3 bench/qwen_summary.py "$OUT"/ps-2g-term.log | tee "$OUT/summary.md"
        mkdir -p "$OUT/mn" && OUT=$OUT/mn ONE_S=${ONE_S:-90} TWO_S=${TWO_S:-110} timeout 240 bash bench/gpu_multinode.sh
        S=(python3 -m trainer --preset h200-small --variant eager --topology procsplit --steps 1000000 --wandb off
           --out /tmp/sruns)
        timeout -s TERM "${S1_S:-60}" "${S[@]}" --run-name small-1g --targets cuda:0 --drafters cuda:0 >"$OUT/small-1g.log" 2>&1
        timeout -s TERM "${S2_S:-70}" "${S[@]}" --run-name small-2g --targets cuda:0,cuda:1 --drafters cuda:0,cuda:1 \
            >"$OUT/small-2g.log" 2>&1
        python3 bench/qwen_summary.py --preset h200-small "$OUT"/small-*.log | tee -a "$OUT/summary.md"
        # the device tool returns at most 8 files: once they are all in logs.tgz, keep only it and the summary
        tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.md -delete && mv /tmp/logs.tgz "$OUT/" ;;
    e2e)
        # GPU 0: dfo end to end, both chains; GPU 1 meanwhile: one drafter layer's compile alone (cold);
        # then both GPUs: h200-small procsplit as 1 node vs 2 nodes (bench/gpu_multinode.sh)
        ( CUDA_VISIBLE_DEVICES=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind-layer timeout -s TERM "${LAYER_S:-300}" \
              python3 bench/gpu_probe.py --out "$OUT/p-layer" --part layer >"$OUT/layer.log" 2>&1 ) &
        CUDA_VISIBLE_DEVICES=0 CHAIN_TIMEOUT=${CHAIN_TIMEOUT:-150} timeout 330 \
            bash bench/gpu_dfo_e2e.sh --procsplit 2>&1 | tee "$OUT/e2e.txt"
        wait
        mkdir -p "$OUT/mn" && OUT=$OUT/mn ONE_S=${ONE_S:-80} TWO_S=${TWO_S:-100} timeout 230 bash bench/gpu_multinode.sh ;;
    *) echo "usage: bash bench/gpu_all.sh current|current1|single1|scaling|qwen|small|regional|e2e" >&2; exit 2 ;;
esac
