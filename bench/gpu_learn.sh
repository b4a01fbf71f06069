#!/usr/bin/env bash
# Issue 16 (the drafter learnt nothing on the GPU presets): does each preset's drafter learn now, against
# the data before the fix, in one device call on nvidia-h200 (~3 min), from the repository root:
#   bash bench/gpu_learn.sh
# Each run's log lands in $OUT as it comes, then $OUT/summary.txt holds every run's step lines
# (loss, acc, accept_len). Runs are eager threads (no compilation: the first step comes at once), side by
# side on the one GPU (throughput figures from them mean nothing): qwen3-8b-shape 250 steps
# (target.compile=off) and h200-small 500 steps, each as the preset is and with the data of before
# (`old`). $SMALL and $QWEN (space-separated NAME:KEY=VALUE,KEY=VALUE; `NAME:` alone = the preset) replace
# the lists.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)" >"$OUT/meta.txt"
SMALL=${SMALL:-"preset: old:data.markov_tokens=0,data.markov_stay=0.9"}
QWEN=${QWEN:-"preset: old:data.markov_tokens=0"}
one() {  # one PRESET STEPS LOG_EVERY SECONDS NAME:SETS
    local preset=$1 steps=$2 every=$3 secs=$4 name=${5%%:*} sets=${5#*:} args=() kv
    for kv in ${sets//,/ }; do args+=(--set "$kv"); done
    timeout -s TERM "$secs" python3 -m trainer --preset "$preset" --variant eager --steps "$steps" \
        --log-every "$every" --wandb off --out /tmp/learn-runs --run-name "$preset-$name" \
        --set target.compile=off "${args[@]}" >"$OUT/$preset-$name.log" 2>&1
    echo "$preset-$name rc=$?" >>"$OUT/rc.txt"
}
set -f
read -ra qwen <<<"$QWEN"; read -ra small <<<"$SMALL"
for spec in "${qwen[@]}"; do one qwen3-8b-shape 250 25 240 "$spec" & done
( for spec in "${small[@]}"; do one h200-small 500 50 120 "$spec"; done ) &
wait
for log in "$OUT"/*.log; do
    echo "== $(basename "$log" .log)"
    grep -o "event=step step=[0-9]* .*accept_len=[0-9.]*" "$log" | sed 's/event=step //; s/tok_s=[0-9.]* //'
done | tee "$OUT/summary.txt"
