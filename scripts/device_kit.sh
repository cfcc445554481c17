#!/usr/bin/env bash
# The device kit in one command. On a machine with PyPI, first:
#     python3 scripts/device_kit.py prepare          # .kit/: trimmed sdist, vocab, wheels (~9 MiB)
# Then on the device (no network; carry .kit), from the repository root:
#     bash scripts/device_kit.sh                     # exit 3: still building, run it again
# and on a CPU-only machine the same with a CPU build and scaled-down shapes (~7+ min on 2 cores):
#     bash scripts/device_kit.sh --cpu --tiny
# or in a minute with the installed llama-cpp-python and tiny shapes (what the tests run):
#     bash scripts/device_kit.sh --fast
# Results (JSON, Markdown reports) go to $OUT (default kit-results/).
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=${KIT:-.kit}
WORK=${WORK:-/tmp/specrun-kit}
OUT=${OUT:-kit-results}
PY=${PYTHON:-python3}
FAST=0
for arg in "$@"; do [ "$arg" = "--fast" ] && FAST=1; done
if [ "$FAST" = 0 ]; then
    # Build in the background; this call polls for at most WAIT seconds (each device command
    # must end within 10 minutes), and a later call picks the same build up again.
    status=0
    "$PY" scripts/device_kit.py build --kit "$KIT" --work "$WORK" --out "$OUT" --wait "${WAIT:-540}" "$@" || status=$?
    if [ "$status" = 3 ]; then echo "[kit] still building: run this command again" >&2; exit 3; fi
    [ "$status" = 0 ] || exit "$status"
    "$PY" scripts/device_kit.py install --kit "$KIT" --work "$WORK" --out "$OUT"
    export PYTHONPATH="$PWD:$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" scripts/device_kit.py measure --kit "$KIT" --work "$WORK" --models "$WORK/models" --out "$OUT" "$@"
echo "[kit] results in $OUT" >&2
