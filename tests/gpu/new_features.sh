#!/usr/bin/env bash
# The GPU tests of the features that compile a specialisation of their own per call (user expressions)
# or that warm.py's plain set does not cover in full (merge, packed GQA, split-KV), spread over the
# cores, then their benchmarks; one device call (about 5 minutes on the H200 machine). The rest of the
# suite runs after tests/gpu/warm.py:
#   python3 -m pytest -q tests --ignore=tests/test_user_mods.py -k "not test_specialisation_compiles"
# Usage, from the repository root on a GPU machine: tests/gpu/new_features.sh [out_dir]
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out="${1:-/tmp}"
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python3 -m pytest -q -n 16 tests/test_user_mods.py tests/test_merge.py tests/test_fold.py tests/test_kvcache.py \
    tests/test_splits.py 2>&1 | tail -15
timeout 40 python3 benchmarks/merge.py --repeats 10 --dtypes fp16 2>&1 | tail -12
timeout 300 python3 benchmarks/bench.py --decode --systems cupyflash-v2 torch-flash torch-cudnn --out-dir "$out" 2>&1 \
    | tail -30
