#!/usr/bin/env bash
# The GPU check (issues 47, 59; docs/gpu.md, "The GPU check"): the GPU figures in one call of the `device` tool.
#
#   here   make gpu-check                     fills .gpu-check/ (wheels the image lacks, SmolLM2's tokenizer, items)
#   there  bash tools/gpu_check.sh            device run: carry [".gpu-check"], timeout_s 300
#   here   bash tools/gpu_check.sh --cpu-smoke   the same parts at toy sizes under Triton's interpreter (CI)
#
# One call of at most CALL_S, its setup included, so that a failed first call can be fixed and run again within a
# session's 15 minutes of device time once the machine's start is counted. The parts run most valuable first, each a
# process of its own under its own cap, and each writes $OUT/<part>.json as it goes, so a run cut short still returns
# what it measured. Logs go to $OUT/check.log (a device call returns at most 8 files); stdout gets the plan, one line
# a part, the log's tail of a part that failed, and the summary table last.
set -uo pipefail
cd "$(dirname "$0")/.."

# The budget, read by tests/test_gpu_check.py off the plan line below: setup + every part's cap and kill grace +
# the summary must fit the call.
CALL_S=300       # the device call's timeout_s
SETUP_CAP=15     # wheels installed, the tree linked, the GPU named (2 s on 2026-11-28)
GRACE=2          # timeout -k: a part that outlives its cap's SIGTERM is killed this much later
SUMMARY_CAP=10   # the summary table (a Python that imports torch)
# part:cap in seconds, most valuable first: the tests (a failure is a bug to fix before the second call), the peaks
# every floor is measured against, the 8B-shaped end to end, the kernels, the CUDA graphs, the SmolLM2-shaped end to
# end. GPU_CHECK_PARTS="tests" reruns some parts alone (a second call, after a fix).
PLAN="tests:100 peaks:15 e2e-8b:70 kernels:20 graphs:25 e2e-smol:30"

FOLDER=${GPU_CHECK_FOLDER:-.gpu-check}
SMOKE=""
SCALE=1
[[ "${1:-}" == "--cpu-smoke" ]] && SMOKE="--cpu-smoke"
OUT=${OUT:-/tmp/kvrag-gpu-check}
mkdir -p "$OUT"
LOG="$OUT/check.log"
: > "$LOG"
START=$(date +%s)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

total=$SETUP_CAP
for spec in $PLAN; do total=$(( total + ${spec##*:} + GRACE )); done
total=$(( total + SUMMARY_CAP ))
echo "gpu_check: plan: setup $SETUP_CAP, $PLAN (each +$GRACE), summary $SUMMARY_CAP: $total s of the call's $CALL_S"
if (( total > CALL_S )); then
  echo "gpu_check: the caps sum to $total s, over the call's $CALL_S"; exit 2
fi
if [[ ! -f $FOLDER/manifest.json ]]; then
  echo "gpu_check: $FOLDER is missing: run \`make gpu-check\` first (it needs PyPI)"; exit 2
fi

if [[ -z $SMOKE ]]; then
  # The image's python3 holds torch and Triton; what it lacks installs into a target folder (no venv, no index),
  # and kvrag is this tree, through a link named kvrag.
  PY=python3
  SITE=/tmp/kvrag-site PKG=/tmp/kvrag-pkg
  if ls $FOLDER/wheels/*.whl > /dev/null 2>&1 && ! timeout $(( SETUP_CAP - 5 )) $PY -m pip install -q --no-index \
      --no-deps --no-compile --no-cache-dir --upgrade --target $SITE $FOLDER/wheels/*.whl >> "$LOG" 2>&1; then
    echo "gpu_check: installing the wheels failed:"; tail -5 "$LOG"
  fi
  mkdir -p $PKG && ln -sfn "$PWD" $PKG/kvrag
  export PYTHONPATH=$PKG:$SITE${PYTHONPATH:+:$PYTHONPATH}
  { timeout 4 nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv; $PY -V; } >> "$LOG" 2>&1
  echo "gpu_check: setup $(( $(date +%s) - START )) s"
else
  PY=${PYTHON:-.venv/bin/python}
  export TRITON_INTERPRET=1
  SCALE=4  # the caps are the device's; 2 shared CPU cores under the interpreter get longer
fi

part() {  # part NAME CAP: one part, killed at CAP seconds or at what the call has left (its JSON so far stays)
  local start=$(date +%s) rc cap=$(( $2 * SCALE ))
  local left=$(( (START + CALL_S * SCALE) - start - (SUMMARY_CAP + GRACE) * SCALE ))
  (( left < cap )) && cap=$left
  if (( cap <= 0 )); then echo "gpu_check: $1 skipped: the call has no time left"; return; fi
  echo "=== $1 (cap $cap s)" >> "$LOG"
  timeout -k "$GRACE" "$cap" $PY -m kvrag.bench.gpu_check "$1" --out "$OUT" --folder $FOLDER $SMOKE >> "$LOG" 2>&1
  rc=$?
  echo "gpu_check: $1 exit $rc in $(( $(date +%s) - start )) s (cap $cap s)$([[ $rc == 124 ]] && echo ': cut at its cap')"
  if [[ $rc != 0 ]]; then sed -n "/^=== $1 /,\$p" "$LOG" | tail -15; fi
}

names=""
for spec in $PLAN; do names+="${spec%%:*} "; done
PARTS=" ${GPU_CHECK_PARTS:-$names} "
for spec in $PLAN; do
  [[ $PARTS == *" ${spec%%:*} "* ]] && part "${spec%%:*}" "${spec##*:}"
done
timeout -k "$GRACE" $(( SUMMARY_CAP * SCALE )) $PY -m kvrag.bench.gpu_check summary --out "$OUT" --folder $FOLDER $SMOKE
