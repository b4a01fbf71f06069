#!/usr/bin/env bash
# Issue 16's measurements on nvidia-h200-x2, one device call each (~9 min), from the repository root;
# every result lands under $OUT as it comes (a call that runs out of time keeps what it measured):
#   bash bench/gpu_probe.sh probe   GPU 0: bench/gpu_probe.py --part target (eager vs compiled layers), then
#                                   qwen3-8b-shape threads nographs, drafter.compile_scope=layers and
#                                   target.compile=layers; GPU 1: --part drafter, scope layers then whole.
#   bash bench/gpu_probe.sh scale   qwen3-8b-shape procsplit nographs (scope layers, target compiled):
#                                   1 GPU on each GPU at once (cold; the cache of each device index), then
#                                   both GPUs as one run (cache-warm), then --part layer and --part head
#                                   (one region alone each, cold) to see which compile takes the time;
#                                   PIECES=0 stops after the 2-GPU run.
#   bash bench/gpu_probe.sh mfu     nvidia-h200-x2, ~9 min: GPU 0 profiles the drafter step (scope layers, 45
#                                   kernels), GPU 1 times the FlexAttention variants (--part attention); then
#                                   qwen3-8b-shape procsplit nographs, 1 GPU at data.batch=1 (GPU 0) and 2
#                                   (GPU 1) at once, then 2 GPUs at batch 1, then at batch 2 ($PS_S s each).
#   bash bench/gpu_probe.sh cold    one GPU (nvidia-h200): qwen3-8b-shape threads, the preset's defaults
#                                   (scope layers, target compiled), each strategy from a cold inductor
#                                   cache of its own: nographs, trees, notrees, eager (or $STRATEGIES);
#                                   then the summary. $SETS (e.g. "data.batch=2") adds --set KEY=VALUE
#                                   to every run, and $TAG (e.g. "b2") is added to the runs' names;
#                                   $GPU (default 0) is the GPU the runs take.
#   bash bench/gpu_probe.sh variants one GPU (nvidia-h200), ~4-6 min: issue 16's kernel-structure A/Bs into
#                                   $OUT/probe.jsonl, each part cold in a process of its own: target layer and
#                                   forward variants, the head's loss_chunk, drafter layer variants, then
#                                   max-autotune of the target layer (its cold compile seconds); at most
#                                   150+120+90+180 s ($TARGET_S $HEAD_S $DRAFTER_S $AUTOTUNE_S).
#   bash bench/gpu_probe.sh overheads  one GPU (nvidia-h200), ~4 min: the step's overheads before and after
#                                   issue 16's cuts, in one process each: --part optimizer (the clipping as
#                                   a pass of its own vs folded into the fused AdamW), --part mask
#                                   (create_block_mask vs the builder's tables, checked equal), then --part
#                                   drafter --mode layers --before (the whole drafter step both ways,
#                                   alternated, after one compile; 60 kernels listed). $GPU as for cold.
#   bash bench/gpu_probe.sh layout   one GPU, ~1-2 min: --part attention-layout (q/k rotated before their heads
#                                   move forward vs today: one drafter layer fwd+bwd, one target layer forward).
# SIG=KILL ends each run at its time without the trainer's checkpointed stop (~25 s for qwen3-8b-shape).
# Probe processes get their own inductor cache (cold figures); the scale runs share one, named in rc.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)" >"$OUT/meta.txt"
run() {  # run NAME GPUS SECONDS CACHE CMD...: output in $OUT/NAME.log
    local name=$1 gpus=$2 secs=$3 cache=$4; shift 4
    local t0=$SECONDS
    CUDA_VISIBLE_DEVICES=$gpus TORCHINDUCTOR_CACHE_DIR=$cache timeout -s "${SIG:-TERM}" "$secs" "$@" >"$OUT/$name.log" 2>&1
    echo "$name rc=$? wall=$((SECONDS - t0))s cache=$cache ($(du -sm "$cache" 2>/dev/null | cut -f1)MB)" | tee -a "$OUT/rc.txt"
}
QWEN=(python3 -m trainer --preset qwen3-8b-shape --steps 1000000 --wandb off --out /tmp/qruns)
REGIONAL=(--set drafter.compile_scope=layers --set target.compile=layers)
case "${1:-}" in
probe)
    (
        run target 0 150 /tmp/ind-target python3 bench/gpu_probe.py --out "$OUT/p-target" --part target
        run thr-layers 0 "${THR_S:-330}" /tmp/ind-thr "${QWEN[@]}" --variant nographs --run-name thr-layers "${REGIONAL[@]}"
    ) &
    (
        run d-layers 1 220 /tmp/ind-dl python3 bench/gpu_probe.py --out "$OUT/p-layers" --part drafter --mode layers
        run d-whole 1 "${WHOLE_S:-260}" /tmp/ind-dw python3 bench/gpu_probe.py --out "$OUT/p-whole" --part drafter --mode whole
    ) &
    wait ;;
scale)
    C=/tmp/ind-scale
    run ps-1g-gpu0 0,1 "${P1_S:-270}" $C "${QWEN[@]}" --variant nographs --topology procsplit --run-name ps-1g-gpu0 \
        --targets cuda:0 --drafters cuda:0 "${REGIONAL[@]}" &
    run ps-1g-gpu1 0,1 "${P1_S:-270}" $C "${QWEN[@]}" --variant nographs --topology procsplit --run-name ps-1g-gpu1 \
        --targets cuda:1 --drafters cuda:1 "${REGIONAL[@]}" &
    wait
    run ps-2g 0,1 "${P2_S:-120}" $C "${QWEN[@]}" --variant nographs --topology procsplit --run-name ps-2g \
        --targets cuda:0,cuda:1 --drafters cuda:0,cuda:1 "${REGIONAL[@]}"
    python3 bench/qwen_summary.py "$OUT"/ps-*.log | tee "$OUT/summary.md"
    [ "${PIECES:-1}" = 0 ] && exit 0
    run layer 0 "${PIECE_S:-200}" /tmp/ind-layer python3 bench/gpu_probe.py --out "$OUT/p-layer" --part layer &
    run head 1 "${PIECE_S:-200}" /tmp/ind-head python3 bench/gpu_probe.py --out "$OUT/p-head" --part head &
    wait ;;
mfu)
    run p-drafter 0 "${PROBE_S:-230}" /tmp/ind-pd python3 bench/gpu_probe.py --out "$OUT/p-drafter" --part drafter \
        --mode layers --rows 45 &
    run p-attn 1 "${PROBE_S:-230}" /tmp/ind-pa python3 bench/gpu_probe.py --out "$OUT/p-attn" --part attention &
    wait
    PS=("${QWEN[@]}" --variant nographs --topology procsplit)
    run ps-1g-b1 0,1 "${PS_S:-100}" /tmp/ind-b1 "${PS[@]}" --run-name ps-1g-b1 --targets cuda:0 --drafters cuda:0 &
    run ps-1g-b2 0,1 "${PS_S:-100}" /tmp/ind-b2 "${PS[@]}" --run-name ps-1g-b2 --targets cuda:1 --drafters cuda:1 \
        --set data.batch=2 &
    wait
    python3 bench/qwen_summary.py "$OUT"/ps-*.log >"$OUT/summary.md" 2>&1
    run ps-2g-b1 0,1 "${PS_S:-100}" /tmp/ind-b1 "${PS[@]}" --run-name ps-2g-b1 --targets cuda:0,cuda:1 --drafters cuda:0,cuda:1
    python3 bench/qwen_summary.py "$OUT"/ps-*.log >"$OUT/summary.md" 2>&1
    run ps-2g-b2 0,1 "${PS_S:-100}" /tmp/ind-b2 "${PS[@]}" --run-name ps-2g-b2 --targets cuda:0,cuda:1 --drafters cuda:0,cuda:1 \
        --set data.batch=2
    python3 bench/qwen_summary.py "$OUT"/ps-*.log | tee "$OUT/summary.md" ;;
cold)
    EXTRA=(); for kv in ${SETS:-}; do EXTRA+=(--set "$kv"); done
    for strategy in ${STRATEGIES:-nographs trees notrees eager}; do
        case $strategy in nographs) secs=${NOGRAPHS_S:-170} ;; eager) secs=${EAGER_S:-75} ;; *) secs=${GRAPHS_S:-135} ;; esac
        name="cold-$strategy${TAG:+-$TAG}"
        run "$name" "${GPU:-0}" "$secs" "/tmp/ind-$name" "${QWEN[@]}" --variant "$strategy" --run-name "$name" "${EXTRA[@]}"
        python3 bench/qwen_summary.py "$OUT"/cold-*.log >"$OUT/summary.md" 2>&1
    done
    cat "$OUT/summary.md" ;;
variants)
    rm -rf /tmp/ind-v-*
    PROBE=(python3 bench/gpu_probe.py --out "$OUT")
    run v-target 0 "${TARGET_S:-150}" /tmp/ind-v-target "${PROBE[@]}" --part target-variants \
        --variants today,fused,rope-bf16,flash,cudnn,cudnn-repeat-kv
    run v-head 0 "${HEAD_S:-120}" /tmp/ind-v-head "${PROBE[@]}" --part head-variants
    run v-drafter 0 "${DRAFTER_S:-90}" /tmp/ind-v-drafter "${PROBE[@]}" --part drafter-variants
    # max-autotune first in its process: its first_s is the cold compile (the 60 s first-step budget)
    run v-autotune 0 "${AUTOTUNE_S:-180}" /tmp/ind-v-autotune "${PROBE[@]}" --part target-variants \
        --variants max-autotune,fused-max-autotune ;;
layout)
    run v-layout "${GPU:-0}" "${LAYOUT_S:-150}" /tmp/ind-v-layout python3 bench/gpu_probe.py --out "$OUT" --part attention-layout
    grep -h '"ms"' "$OUT/probe.jsonl" | cut -c1-220 ;;
overheads)
    run p-optimizer "${GPU:-0}" 120 /tmp/ind-po python3 bench/gpu_probe.py --out "$OUT/p-overheads" --part optimizer
    run p-mask "${GPU:-0}" 60 /tmp/ind-pm python3 bench/gpu_probe.py --out "$OUT/p-overheads" --part mask
    run p-step "${GPU:-0}" "${PROBE_S:-240}" /tmp/ind-ps python3 bench/gpu_probe.py --out "$OUT/p-overheads" \
        --part drafter --mode layers --before --rows 60
    grep -h '"ms"' "$OUT/p-overheads/probe.jsonl" ;;
*) echo "usage: bash bench/gpu_probe.sh probe|scale|mfu|cold|variants|layout|overheads" >&2; exit 2 ;;
esac
