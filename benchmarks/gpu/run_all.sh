#!/usr/bin/env bash
# The GPU runbook (issue 25), as the device machine runs it: from the repository root,
#   bash benchmarks/gpu/run_all.sh                 # every part, figures under $OUT
#   PARTS=env,pytest,engine bash benchmarks/gpu/run_all.sh
# The device tool allows 10 minutes a command, so docs/gpu/README.md runs it as two calls (two
# PARTS groups, DEADLINE=560 each) and merges their reports here afterwards.
# Environment: OUT (required: where the JSON and report.md go), PARTS (default: all), DEADLINE
# (seconds for all parts together; default 1380), WHEELS (default .whl: the carried wheels).
# Exit status: 0 when every part succeeded, 1 when one failed (the rest still ran), 2 on bad input.
set -u
cd "$(dirname "$0")/../.." || exit 2
: "${OUT:?set OUT to the folder for the figures (the device tool sets it)}"
WHEELS="${WHEELS:-.whl}"
PY="${PYTHON:-python3}"

# megatron-core is not on the GPU image and nothing can be fetched there: install the carried
# wheel (pip download megatron-core==0.16.1 --no-deps ..., docs/gpu/README.md) without its
# dependencies (torch, numpy, packaging are on the image), into a folder of its own.
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/megarl-site \
    "$WHEELS"/*.whl || echo "run_all.sh: installing $WHEELS/*.whl failed; parts that need megatron-core will fail"
  export PYTHONPATH="/tmp/megarl-site${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "run_all.sh: no wheels in $WHEELS/ (megatron-core missing unless installed): the grpo parts and the" \
       "trainer test will fail and be recorded"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's megarl, also in every part's children
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export MEGARL_GPU_WORK="${MEGARL_GPU_WORK:-/tmp/megarl-gpu-work}"  # run dirs, logs: not under $OUT (8 files back)

"$PY" -m megarl.bench.gpu --out "$OUT" --work-dir "$MEGARL_GPU_WORK" ${PARTS:+--parts "$PARTS"} \
  --deadline "${DEADLINE:-1380}" "$@"
