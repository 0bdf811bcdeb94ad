#!/usr/bin/env bash
# The balanced cut of whole requests (schedule.balanced_schedule_device) measured in one device
# call of at most ~585 s: its GPU tests first (a cut that fails there is not timed), then the cut
# against the split schedule (and, when it ran, the contiguous cut it replaced) on the h=128 rows it
# takes, the issue's 1.2x V4 rows against FlashMLA, the K-buffer staging variant on the balanced
# rows, and the CTA spans' spread under the cut, each if the call has time left. Logs land in $OUT
# (or ./artifacts).
#   source .gpu/activate.sh && export PYTHONPATH=$PWD:$PYTHONPATH CUTE_MLA_COMMIT=<sha> && bash benchmarks/balanced_cut_check.sh
set -u
BUDGET=${BUDGET:-585}
source "$(dirname "$0")/step.sh"
# 1. correctness: the reference's answer under the cut, eager, in a captured schedule, traced
if ! TAIL=16 step tests 240 python3 -m pytest -q -rf -p no:cacheprovider $XDIST -m gpu tests/test_v4_gpu.py \
    tests/test_custom_op.py -k "balanced_whole or 400-1-128"; then
  echo "== the cut's tests did not pass: nothing is timed"; exit 1
fi
# 2. the cut against the split schedule, end to end, interleaved
TAIL=8 step cuts 150 python3 -m benchmarks.v4_schedule_probe --rounds 7 \
  --rows "512,128,1024;512,128,512;400,128,1024;1024,128,1024"
# 3. the issue's 1.2x rows against FlashMLA
TAIL=12 step v4-grid 120 python3 -m benchmarks.bench_v4 --draws 5 --rows "$V4_TARGET" --out "$OUT/v4-target.json"
# 4. the K-buffer staging on the balanced rows (every partition holds ~8 whole requests)
TAIL=6 step stage-in-k 100 python3 -m benchmarks.v4_variants --variants stage_in_k --rounds 5 \
  --rows "512,128,1024;512,128,512"
# 5. the CTA spans under the cut
TAIL=8 step spans 60 python3 -m benchmarks.v4_timeline --spans --rows "512,128,1024" --replays 3
