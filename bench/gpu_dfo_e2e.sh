#!/usr/bin/env bash
# dfo end to end on a machine with a real GPU and nvidia-smi (the device tool's H200): the `local` target,
# the real trainer, `dfo launch ... --watch --until-decided --json`, with the fallback chain of
# bench/h200-e2e.yaml. Prints a summary; leaves the JSON event streams, registry dumps and run logs in
# $OUT/e2e.tgz (OUT defaults to ./out). Needs dfo's dependencies importable (carried wheels on the device).
# Usage: bench/gpu_dfo_e2e.sh [--procsplit]   (--procsplit: also the chain trees -> ps-trees -> nographs)
# Environment: PYTHON (default python3), E2E_INVENTORY, CHAIN_TIMEOUT (s per chain, default 170), E2E_EXTRA (more
# launch options, e.g. --force when another job holds a GPU outside the target).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
W=$(mktemp -d); WS=/tmp/dfo-ws; PY=${PYTHON:-python3}
export DFO_HOME=$W/home DFO_INVENTORY=${E2E_INVENTORY:-bench/h200-e2e.yaml} PYTHONUNBUFFERED=1
dfo() { "$PY" -c 'import sys; from orchestrator.cli import main; sys.argv[0] = "dfo"; main()' "$@"; }
nvidia-smi --query-gpu=index,name,memory.used,memory.total,utilization.gpu --format=csv,noheader
dfo preflight --host h200
chain() {  # $1: label, rest: launch arguments
    local label=$1; shift
    local t0; t0=$(date +%s.%N)
    timeout "${CHAIN_TIMEOUT:-170}" "$PY" -c 'import sys; from orchestrator.cli import main; sys.argv[0] = "dfo"; main()' \
        launch --host h200 "$@" ${E2E_EXTRA:-} --watch --until-decided --json >"$W/$label.jsonl" 2>"$W/$label.err"
    local rc=$?
    echo "== $label: dfo exit $rc after $("$PY" -c "import time; print(round(time.time() - $t0, 1))") s"
    "$PY" - "$W/$label.jsonl" <<'PY'
import json, sys
t0 = None
for line in open(sys.argv[1]):
    try:
        ev = json.loads(line)
    except ValueError:
        continue
    kind = ev.get("kind") or ("final" if "decision" in ev and "kind" not in ev else "?")
    if kind in ("step", "gpu"):
        continue
    print(" ", json.dumps(ev)[:400])
PY
    dfo runs --json >"$W/$label.runs.json"
    for n in $("$PY" -c "import json; print(' '.join(r['name'] for r in json.load(open('$W/$label.runs.json')) if r['state'] == 'running'))"); do
        dfo stop "$n" --grace 20 >/dev/null 2>&1
    done
    mkdir -p "$W/$label.logs"; cp $WS/logs/* "$W/$label.logs/" 2>/dev/null; rm -f $WS/logs/*
}
chain threaded --variant trees --name e2e
[ "${1:-}" = "--procsplit" ] && chain procsplit --variant trees --name e2p --chain trees,ps-trees,nographs
dfo runs
tar czf "$OUT/e2e.tgz" -C "$W" .
