#!/usr/bin/env bash
# A release's whole GPU check in one device call of at most ~590 s, most important first: the whole
# GPU suite, the V4 grid against FlashMLA (the README's V4 table, 5 draws a row), then the V3.2
# grid against FlashMLA (the README's table), each as far as the call's time allows. Logs and the
# results JSON land in $OUT (or ./artifacts). The suite outlasted 220 s with 8 workers on an H100
# (620 of 696 results), hence TESTS_S 330; the V3.2 grid then gets what is left (V32_ROWS=quick: ~15 s).
#   source .gpu/activate.sh && export PYTHONPATH=$PWD:$PYTHONPATH CUTE_MLA_COMMIT=<sha> && bash benchmarks/release_check.sh
set -u
BUDGET=${BUDGET:-590}
source "$(dirname "$0")/step.sh"
TAIL=12 step tests "${TESTS_S:-330}" python3 -m pytest -q -rf -p no:cacheprovider $XDIST -m gpu tests
TAIL=30 step v4 "${V4_S:-150}" python3 -m benchmarks.bench_v4 --draws 5 --out "$OUT/v4.json"
TAIL=40 step v32 $((BUDGET - SECONDS)) python3 -m benchmarks.bench_sparse_decode --rows "${V32_ROWS:-all}" --json "$OUT/v32.json"
