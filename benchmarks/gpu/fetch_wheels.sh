#!/usr/bin/env bash
# Fetches, on a machine with PyPI, what the GPU runbook needs beyond the GPU machine's image
# (Python 3.12, torch, Triton, transformers; no network there), into .whl/ at the repository root
# (ignored by git; it is sent with the working tree, named explicitly):
#   .whl/megatron_core-0.16.1-cp312-...whl   megatron-core for CPython 3.12 on x86_64 Linux; its
#                                            Requires-Dist (torch, numpy, packaging) is on the image
#   .whl/ifmissing/*.whl                     pytest and its dependencies, pytest-timeout, packaging
#                                            (pure Python): each installed there only if the image
#                                            cannot import it (run_all.sh)
# Then checks that what travels (tracked files, untracked files git does not ignore, and .whl/)
# stays under the 64 MiB that may travel with the working tree.
#   bash benchmarks/gpu/fetch_wheels.sh          # PYTHON=... to use another interpreter's pip
# Exit status: 0 when everything is fetched and fits, 1 otherwise.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
WHEELS=.whl
LIMIT_BYTES=$((64 * 1024 * 1024))

if ! git check-ignore -q "$WHEELS/x.whl"; then
  echo "fetch_wheels.sh: $WHEELS/ is not ignored by git here (.gitignore has /.whl/); refusing to fill it" >&2
  exit 1
fi
rm -rf "$WHEELS.tmp" && mkdir -p "$WHEELS.tmp/ifmissing"
# Binary wheels for the GPU machine's interpreter, whatever this machine's Python is.
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d "$WHEELS.tmp" "megatron-core==0.16.1"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform any \
  -d "$WHEELS.tmp/ifmissing" "pytest>=8,<10" "pluggy>=1.6,<2" "iniconfig>=2" \
  "pygments>=2.15" "pytest-timeout>=2.3" "packaging>=24.2"
rm -rf "$WHEELS" && mv "$WHEELS.tmp" "$WHEELS"  # all or nothing: a failed fetch leaves the old folder

tracked=$(git ls-files -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
untracked=$(git ls-files -z --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
wheels=$(du -sb "$WHEELS" | cut -f1)
total=$((tracked + ${untracked:-0} + wheels))
find "$WHEELS" -type f -name '*.whl' -printf '%s bytes  %p\n' | sort -k3
printf 'travels: tracked %d + untracked %d + %s %d = %d bytes (%.1f MiB of 64 MiB)\n' \
  "$tracked" "${untracked:-0}" "$WHEELS" "$wheels" "$total" "$(awk "BEGIN {print $total / 1048576}")"
if [ "$total" -gt "$LIMIT_BYTES" ]; then
  echo "fetch_wheels.sh: what travels is over 64 MiB; remove large untracked files or send fewer wheels" >&2
  exit 1
fi
