#!/usr/bin/env bash
# The experimental Sm90Tuning.stage_in_k (docs/performance.md, section 5) measured in one device
# call of at most ~585 s: its GPU tests first (a variant that fails or hangs there is not timed),
# then the A/B against the default on V4 and V3.2 rows, the V3.2 latency rows per call in a
# 16-call graph, the CTA spans' fit under both kernels, and the issue's 1.2x V4 rows against
# FlashMLA with the variant if at least GRID_MIN_S seconds are left. Each step's log lands in $OUT (or ./artifacts).
#   source .gpu/activate.sh && export PYTHONPATH=$PWD:$PYTHONPATH CUTE_MLA_COMMIT=<sha> && bash benchmarks/stage_in_k_check.sh
set -u
BUDGET=${BUDGET:-585}
GRID_MIN_S=${GRID_MIN_S:-200}
source "$(dirname "$0")/step.sh"
# 1. correctness: bit-identical to the default, the reference's answer, no hang (29 tests)
if ! TAIL=16 step tests 200 python3 -m pytest -q -rf -p no:cacheprovider $XDIST -m gpu tests/test_sm90_gpu.py -k stage_in_k; then
  echo "== the variant's tests did not pass: nothing is timed"; exit 1
fi
# 2. A/B on the V4 target rows and b=32 h=128
TAIL=12 step v4-ab 150 python3 -m benchmarks.v4_variants --variants stage_in_k --rounds 5 \
  --rows "$V4_TARGET;32,128,1024"
# 3. V3.2: the edge cases' bits, then the throughput rows, then the latency rows per call in a 16-call graph
TAIL=12 step v32-ab 100 python3 -m benchmarks.variants --variants default,stage_in_k --rows "1,1024,64;128,2,128;1,1024,128;64,2,64"
TAIL=8 step v32-latency 60 python3 -m benchmarks.variants --variants default,stage_in_k --skip-edge --layers 16 \
  --rows "1,1,64;1,8,64;1,1,128;1,8,128"
# 4. where the time goes: the CTA spans' per-tile and per-piece fit under each kernel
TAIL=20 step spans 90 python3 -m benchmarks.v4_timeline --spans --rows "512,128,1024;128,128,1024" \
  --variants default,stage_in_k --replays 3
# 5. the V4 target rows against FlashMLA with the variant, if the call has time left
if [ $((BUDGET - SECONDS)) -ge "$GRID_MIN_S" ]; then
  TAIL=16 step v4-grid $((BUDGET - SECONDS)) python3 -m benchmarks.bench_v4 --variant stage_in_k --draws 5 \
    --rows "$V4_TARGET" --out "$OUT/v4-stage-in-k.json"
else
  echo "== v4-grid: skipped, $((BUDGET - SECONDS)) s left (GRID_MIN_S=$GRID_MIN_S)"
fi
