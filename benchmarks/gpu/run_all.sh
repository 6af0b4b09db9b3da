#!/usr/bin/env bash
# The GPU runbook as the GPU machine runs it, from the repository root (docs/gpu/README.md):
#   OUT=/some/dir bash benchmarks/gpu/run_all.sh                  # the quick profile, <= 420 s
#   OUT=/some/dir RERUN=docs/gpu/runs/DATE DEADLINE=240 bash benchmarks/gpu/run_all.sh
#                                              # only the parts that did not finish in that folder
#   OUT=/some/dir bash benchmarks/gpu/run_all.sh --set engine.batch_sizes=[1,8]   # any part's shapes
# Environment: OUT (required: where PART.jsonl, summary.json and report.md go), PROFILE (quick;
# full: the targets' shapes, ~19 min), PARTS (default: all, in the runbook's order), RERUN (an
# earlier run's out folder, copied into the checkout), DEADLINE (seconds for all parts; default per
# profile), WHEELS (default .whl: what benchmarks/gpu/fetch_wheels.sh fetched), MEGARL_SITE (where
# they are installed; default /tmp/megarl-site). Arguments go to
# `python -m benchmarks.gpu.runbook`.
# Exit status: 0 when every part succeeded, 1 when one failed (the rest still ran), 2 on bad input.
set -u
cd "$(dirname "$0")/../.." || exit 2
: "${OUT:?set OUT to the folder for the figures}"
WHEELS="${WHEELS:-.whl}"
PY="${PYTHON:-python3}"
SITE="${MEGARL_SITE:-/tmp/megarl-site}"  # where the wheels are installed

# What the image lacks, from the wheels that travel, without their dependencies and without network,
# into a folder of its own: megatron-core always; pytest & co. only where the image cannot import them.
install() {  # wheel files...
  if "$PY" -m pip --version >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$@"
  else  # no pip on the image: a wheel is a zip of its site-packages files
    for w in "$@"; do "$PY" -m zipfile -e "$w" "$SITE" || return 1; done
  fi
}
mkdir -p "$SITE"
if ls "$WHEELS"/megatron_core-*.whl >/dev/null 2>&1; then
  install "$WHEELS"/megatron_core-*.whl || echo "run_all.sh: installing megatron-core failed; the grpo parts and the" \
    "trainer test will fail and be recorded"
else
  echo "run_all.sh: no megatron-core wheel in $WHEELS/ (bash benchmarks/gpu/fetch_wheels.sh, then send $WHEELS/ with the tree):" \
       "the grpo parts and the trainer test will fail unless the image has it"
fi
for w in "$WHEELS"/ifmissing/*.whl; do
  [ -e "$w" ] || continue
  name=$(basename "$w"); name="${name%%-*}"
  "$PY" -c "import $name" 2>/dev/null || install "$w" || echo "run_all.sh: installing $w failed"
done
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's megarl, also in every part's children
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# Megatron's bias/activation fusions are torch.compile'd and on under CUDA: a cold compile per
# trainer process. Off (eager) unless the caller sets TORCHDYNAMO_DISABLE=0 to measure them.
export TORCHDYNAMO_DISABLE="${TORCHDYNAMO_DISABLE:-1}"
export MEGARL_GPU_WORK="${MEGARL_GPU_WORK:-/tmp/megarl-gpu-work}"  # run dirs, logs: not under $OUT (8 files back)

"$PY" -m benchmarks.gpu.runbook --out "$OUT" --work-dir "$MEGARL_GPU_WORK" --profile "${PROFILE:-quick}" \
  ${PARTS:+--parts "$PARTS"} ${RERUN:+--rerun-failed "$RERUN"} ${DEADLINE:+--deadline "$DEADLINE"} "$@"
