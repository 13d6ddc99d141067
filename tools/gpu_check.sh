#!/usr/bin/env bash
# The GPU check (issue 47; docs/gpu.md, "The GPU check"): every GPU figure in one call of the `device` tool.
#
#   here   make gpu-check                     fills .gpu-check/ (wheels the image lacks, SmolLM2's tokenizer, items)
#   there  bash tools/gpu_check.sh            device run: carry [".gpu-check"], timeout_s 540
#   here   bash tools/gpu_check.sh --cpu-smoke   the same parts at toy sizes under Triton's interpreter (CI)
#
# Each part is a process of its own under its own cap (seconds, below) and writes $OUT/<part>.json as it goes, so
# a run cut short still returns what it measured. Logs go to $OUT/check.log (a device call returns at most 8
# files); stdout gets one line a part, the log's tail of a part that failed, and the summary table last.
set -uo pipefail
cd "$(dirname "$0")/.."
FOLDER=${GPU_CHECK_FOLDER:-.gpu-check}
SMOKE=""
SCALE=1
[[ "${1:-}" == "--cpu-smoke" ]] && SMOKE="--cpu-smoke"
OUT=${OUT:-/tmp/kvrag-gpu-check}
mkdir -p "$OUT"
LOG="$OUT/check.log"
: > "$LOG"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [[ ! -f $FOLDER/manifest.json ]]; then
  echo "gpu_check: $FOLDER is missing: run \`make gpu-check\` first (it needs PyPI)"; exit 2
fi

if [[ -z $SMOKE ]]; then
  # The image's python3 holds torch and Triton; what it lacks installs into a target folder (no venv, no index),
  # and kvrag is this tree, through a link named kvrag.
  PY=python3
  SITE=/tmp/kvrag-site PKG=/tmp/kvrag-pkg
  start=$(date +%s)
  if ls $FOLDER/wheels/*.whl > /dev/null 2>&1 && ! timeout 45 $PY -m pip install -q --no-index --no-deps \
      --no-compile --no-cache-dir --upgrade --target $SITE $FOLDER/wheels/*.whl >> "$LOG" 2>&1; then
    echo "gpu_check: installing the wheels failed:"; tail -5 "$LOG"
  fi
  mkdir -p $PKG && ln -sfn "$PWD" $PKG/kvrag
  export PYTHONPATH=$PKG:$SITE${PYTHONPATH:+:$PYTHONPATH}
  echo "gpu_check: setup $(( $(date +%s) - start )) s"
  { nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv; $PY -V; } >> "$LOG" 2>&1
else
  PY=${PYTHON:-.venv/bin/python}
  export TRITON_INTERPRET=1
  SCALE=4  # the caps are the device's; 2 shared CPU cores under the interpreter get longer
fi

part() {  # part NAME CAP: one part, killed at CAP seconds (its JSON so far stays)
  local start=$(date +%s) rc cap=$(( $2 * SCALE ))
  set -- "$1" "$cap"
  echo "=== $1 (cap $2 s)" >> "$LOG"
  timeout -k 10 "$2" $PY -m kvrag.bench.gpu_check "$1" --out "$OUT" --folder $FOLDER $SMOKE >> "$LOG" 2>&1
  rc=$?
  echo "gpu_check: $1 exit $rc in $(( $(date +%s) - start )) s (cap $2 s)$([[ $rc == 124 ]] && echo ': cut at its cap')"
  if [[ $rc != 0 ]]; then sed -n "/^=== $1 /,\$p" "$LOG" | tail -15; fi
}

# Caps: 45 + 30 + 60 + 45 + 170 + 60 + 100 = 510 s with the setup, inside the call's 540.
# GPU_CHECK_PARTS="tests" reruns some parts alone (a second call, after a fix, on what is left of the device time).
PARTS=" ${GPU_CHECK_PARTS:-peaks kernels graphs e2e-8b e2e-smol tests} "
for spec in peaks:30 kernels:60 graphs:45 e2e-8b:170 e2e-smol:60 tests:100; do
  [[ $PARTS == *" ${spec%%:*} "* ]] && part "${spec%%:*}" "${spec##*:}"
done
$PY -m kvrag.bench.gpu_check summary --out "$OUT" --folder $FOLDER $SMOKE
