#!/usr/bin/env bash
# Every kernel specialisation (tests/gpu/sanitize.py) under each compute-sanitizer tool; prints
# each tool's error summary and exits non-zero if any tool found an error or a case failed.
# Usage, from the repository root on a GPU machine: tests/gpu/sanitize_all.sh [--quick | --head-dims D ...]
# (SANITIZER_TOOLS="racecheck synccheck" picks the tools; default all four)
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
SANITIZER="${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}"
status=0
for tool in ${SANITIZER_TOOLS:-memcheck racecheck initcheck synccheck}; do
    log="$(mktemp)"
    "$SANITIZER" --tool "$tool" --error-exitcode 1 python3 tests/gpu/sanitize.py "$@" > "$log" 2>&1
    rc=$?
    echo "$tool: rc=$rc; $(grep -E 'cases within tolerance' "$log" | tail -1); $(grep -E '(ERROR|RACECHECK) SUMMARY' "$log" | tail -1)"
    [ "$rc" -eq 0 ] || { status=1; grep -E '^=========' "$log" | head -20; }
    rm -f "$log"
done
exit "$status"
