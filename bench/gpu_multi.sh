python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
# Issue 8 in one device call on a 2-GPU H200 machine (kind nvidia-h200-x2), run from the repository root with
# the carried wheels in .whl/ (the line above):            bash bench/gpu_multi.sh
# Dry run on a machine without GPUs (tiny-cpu on cpu devices, nvidia-smi stand-in, the venv's python):
#     PY=.venv/bin/python bash bench/gpu_multi.sh --cpu
# Steps, each under its own timeout, within GPU_MULTI_BUDGET seconds (default 230); GPU_MULTI_STEPS picks
# some of them (default 123):
#   1 (a)+(b) eager: threaded target cuda:0 / drafters cuda:1,cuda:1 and cuda:0,cuda:1; procsplit 1 vs 2 GPUs
#   2 (c) `dfo launch --variant ps2-eager --watch --until-decided --json` (bench/h200x2-e2e.yaml: local target,
#     GPUs 0 and 1) with drafter 1 made to stop at step 300 for 15 s and then raise: the trainer exits 1 and
#     dfo's final decision says which GPU went idle first
#   3 compiled, in what time is left: threaded nographs, procsplit trees 1 vs 2 GPUs
# $OUT gets: summary.txt (everything to read first), multi.md + multi.json (the throughput table, replica hashes,
# the 1 -> 2 GPU ratio), e2e.jsonl (dfo's JSON stream), logs.tgz (trainer logs, dfo stderr, nvidia-smi samples).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
PY=${PY:-python3}
CPU=0; [ "${1:-}" = "--cpu" ] && CPU=1
[ -n "${PYTHONPATH:-}" ] || export PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
BUDGET=${GPU_MULTI_BUDGET:-230}; T0=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
W=$(mktemp -d); WS=/tmp/dfo-ws; SUMMARY=$OUT/summary.txt
say() { echo "$*" | tee -a "$SUMMARY"; }
export DFO_HOME=$W/home DFO_INVENTORY=bench/h200x2-e2e.yaml
VARIANT=ps2-eager; FAIL_STEP=300; IDLE_S=15
if [ $CPU = 1 ]; then  # the stand-in nvidia-smi (2 busy GPUs) and the venv's python for the trainer
    export PATH=$PWD/tests/harness/bin:$PATH NVIDIA_SMI_STANDIN_STATE=$W/smi.json
    $PY -c "import sys; sys.path.insert(0, 'tests'); from harness.nvidia_smi import Gpu, NvidiaSmiState as S
S('$W/smi.json', [Gpu(i, memory_used_mib=0, utilization_pct=0) for i in (0, 1)])"
    WS=$W/ws  # not the shared /tmp/dfo-ws: other dry runs on this machine use it
    { sed "s#/tmp/dfo-ws#$WS#" bench/h200x2-e2e.yaml; echo "defaults: {python: $PY}"; } >"$W/inv.yaml"
    export DFO_INVENTORY=$W/inv.yaml
    VARIANT=ps2-eager-cpu; FAIL_STEP=40; IDLE_S=6
fi
dfo() { $PY -c 'import sys; from orchestrator.cli import main; sys.argv[0] = "dfo"; main()' "$@"; }
say "== gpu_multi $(date -u +%FT%TZ) cpu=$CPU budget=${BUDGET}s"
timeout 20 nvidia-smi --query-gpu=index,name,memory.used,memory.total,utilization.gpu --format=csv,noheader | tee -a "$SUMMARY"
timeout 20 $PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.device_count())' | tee -a "$SUMMARY"
# per-GPU utilisation all along (one sampler; killed by its PID at the end)
nvidia-smi --query-gpu=timestamp,index,memory.used,utilization.gpu --format=csv,noheader -lms 1000 >"$W/smi.csv" 2>&1 &
SMI=$!
MULTI=(--out "$OUT"); [ $CPU = 1 ] && MULTI+=(--cpu)

STEPS=${GPU_MULTI_STEPS:-123}  # which of the steps below to run, e.g. 2 for dfo's idle-GPU case alone
if [[ $STEPS == *1* ]]; then
say "== 1: eager (a) threaded across GPUs, (b) procsplit 1 vs 2 GPUs"
timeout $(( $(left) > 20 ? $(left) - 75 : 1 )) $PY bench/gpu_multi.py "${MULTI[@]}" --phase eager \
    --budget $(( $(left) - 90 )) 2>&1 | tee -a "$W/multi-eager.out" | grep -v '^{' | tee -a "$SUMMARY"
$PY - "$OUT/multi.json" <<'PY' | tee -a "$SUMMARY"
import json, sys
for r in json.load(open(sys.argv[1])):
    print(f"  {r['case']:16} {r['variant']:8} {r['status']:8} tok/s {r['steady_tok_s'] or 0:>10,.0f} "
          f"replicas {r['replicas']} {r['replica_hashes']} {r['failure'][:200]}")
PY
fi

if [[ $STEPS == *2* ]]; then
say "== 2: dfo launch --watch with drafter 1 stopping at step $FAIL_STEP (idle ${IDLE_S}s, then raise)"
for _ in $(seq 20); do  # the preflight wants idle GPUs: wait for the last case's memory to go
    busy=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | awk '$1 > 1024' | wc -l)
    [ "$busy" = 0 ] && break; sleep 1
done
E2E_T=$(( $(left) > 100 ? 100 : $(left) )); [ $CPU = 1 ] && E2E_T=200
rm -f $WS/logs/e2e-kill.log*
[ $CPU = 1 ] && (  # stand-in GPUs: both busy, then GPU 1 idle once drafter 1 stops (what the H200s should show)
    until grep -qs "event=step " $WS/logs/e2e-kill.log; do sleep 0.2; done
    $PY -c "import sys; sys.path.insert(0, 'tests'); from harness.nvidia_smi import Gpu, NvidiaSmiState as S
S('$W/smi.json', [Gpu(i, memory_used_mib=4000, utilization_pct=90) for i in (0, 1)])"
    until grep -qs "event=step step=$FAIL_STEP " $WS/logs/e2e-kill.log; do sleep 0.2; done
    $PY -c "import sys; sys.path.insert(0, 'tests'); from harness.nvidia_smi import Gpu, NvidiaSmiState as S
S('$W/smi.json', [Gpu(0, memory_used_mib=4000, utilization_pct=100), Gpu(1, memory_used_mib=4000, utilization_pct=0)])"
) &
t=$(date +%s)
timeout "$E2E_T" $PY -c 'import sys; from orchestrator.cli import main; sys.argv[0] = "dfo"; main()' \
    launch --host h200x2 --variant "$VARIANT" --name e2e-kill --chain "$VARIANT" \
    --set debug.fail_at_step=$FAIL_STEP --set debug.fail_drafter=1 --set debug.fail_idle_s=$IDLE_S \
    --watch --until-decided --json >"$OUT/e2e.jsonl" 2>"$W/e2e.err"
say "dfo exit $? after $(( $(date +%s) - t )) s (expected 1: a crash)"
$PY - "$OUT/e2e.jsonl" <<'PY' | tee -a "$SUMMARY"
import json, sys
for line in open(sys.argv[1]):
    try:
        ev = json.loads(line)
    except ValueError:
        continue
    if ev.get("kind") == "gpu":
        continue
    if "kind" not in ev and "decision" in ev:
        print("  FINAL", ev["decision"], ev.get("signature"), "|", ev.get("reason"))
        print("  gpu_idle_first:", json.dumps(ev.get("evidence", {}).get("gpu_idle_first")))
    elif ev.get("kind") in ("gpu_idle", "ended", "decision", "stopped", "action_error", "gpu_error"):
        print(" ", json.dumps(ev)[:300])
gpus = [ev for ev in map(lambda l: json.loads(l) if l.startswith("{") else {}, open(sys.argv[1])) if ev.get("kind") == "gpu"]
print(f"  {len(gpus)} gpu events; last three: " + " | ".join(
    ", ".join(f"GPU{g['index']} {g['util_pct']}% {g['mem_used_mib']}MiB" for g in ev["gpus"]) for ev in gpus[-3:]))
PY
for n in $(dfo runs --json 2>/dev/null | $PY -c "import json,sys; print(' '.join(r['name'] for r in json.load(sys.stdin) if r['state'] == 'running'))"); do
    timeout 40 $PY -c 'import sys; from orchestrator.cli import main; sys.argv[0] = "dfo"; main()' stop "$n" --grace 10 >/dev/null 2>&1
done

fi

say "== 3: compiled strategies, $(left) s left"
if [[ $STEPS == *3* ]] && [ "$(left)" -gt 40 ]; then
    timeout $(( $(left) - 5 )) $PY bench/gpu_multi.py "${MULTI[@]}" --phase compiled --budget $(( $(left) - 10 )) \
        2>&1 | tee -a "$W/multi-compiled.out" | grep -v '^{' | tee -a "$SUMMARY"
fi
kill "$SMI" 2>/dev/null
say "== table"; cat "$OUT/multi.md" >>"$SUMMARY" 2>/dev/null
mkdir -p "$W/logs"; cp "$OUT/multi.log" "$W/logs/" 2>/dev/null && rm -f "$OUT/multi.log"
cp $WS/logs/* "$W/logs/" 2>/dev/null; cp "$W"/*.err "$W"/*.out "$W"/smi.csv "$W/logs/" 2>/dev/null
tar czf "$OUT/logs.tgz" -C "$W" logs
say "== done after $(( $(date +%s) - T0 )) s"
