#!/usr/bin/env bash
# The first run of the SM100 kernel on a B200, in one command (docs/sm100.md, "First run on a B200").
#
#   source .gpu/activate.sh && export PYTHONPATH=$PWD:$PYTHONPATH && bash benchmarks/sm100_first_run.sh
#
# Seven steps in order (1-6: the sparse decode kernel, 7: the sparse prefill kernel); the first one
# that fails stops the run with what it points at (each step assumes the ones before it passed).
# Every log goes to $OUT (default artifacts/sm100-first-run).
#   FROM=N      start at step N (after fixing what an earlier step found)
#   ONLY=N      run step N alone
#   SKIP_BENCH=1  no benchmark (step 6, and step 7's last half)
#   LOOP_ITERS=K  launches per case in step 5 (default 20 under memcheck; racecheck and synccheck run 2)
# A hang ends the step: every GPU test waits for its kernel with a watchdog (the test file's
# finish_or_exit: 60 s, SM100_HANG_TIMEOUT_S), and each step runs under `timeout`. A skipped test
# fails its step too (on a B200 nothing in the file skips), except in step 4's second half: the GPU
# test files every arch shares (SHARED_GPU_TESTS) skip their SM90-only cases there.
set -u -o pipefail
OUT=${OUT:-artifacts/sm100-first-run}
FROM=${FROM:-1}
ONLY=${ONLY:-}
mkdir -p "$OUT"
GPU_TESTS=tests/test_sm100_gpu.py
# the arch-generic GPU tests (the combine, the device scheduler, the V4 sweep, the public API, the
# custom op): on a B200 they compile and run the sm_100a variants
SHARED_GPU_TESTS="tests/test_combine_gpu.py tests/test_scheduler_gpu.py tests/test_v4_gpu.py tests/test_api_gpu.py tests/test_custom_op.py"

fail() {  # step, what it points at
  echo
  echo "FAILED at step $1. $2"
  echo "Logs: $OUT/step$1*. Fix, then rerun from here: FROM=$1 bash benchmarks/sm100_first_run.sh"
  exit 1
}

want() {  # whether step $1 runs
  if [ -n "$ONLY" ]; then [ "$1" = "$ONLY" ]; else [ "$1" -ge "$FROM" ]; fi
}

pytest_step() {  # step, timeout (s), -k expression ("" = every test); fails on a failure, a hang or a skip
  # (ALLOW_SKIPS=1: not on a skip); the files: $GPU_TESTS
  local log="$OUT/step$1.log"
  echo "   pytest $GPU_TESTS ${3:+-k \"$3\"} (log: $log)"
  # shellcheck disable=SC2086  # GPU_TESTS is a list of paths
  timeout "$2" python3 -m pytest -x -q -rfs -p no:cacheprovider $GPU_TESTS ${3:+-k "$3"} >"$log" 2>&1
  local rc=$?
  grep -E "passed|failed|skipped|error|no tests ran" "$log" | tail -2
  if [ $rc -ne 0 ] || { [ "${ALLOW_SKIPS:-0}" != 1 ] && grep -qE "[0-9]+ skipped" "$log"; }; then
    grep -E "^(FAILED|ERROR|SKIPPED)|Error|assert|!!!" "$log" | head -12
    [ $rc -eq 124 ] && echo "   (timed out after $2 s)"
    return 1
  fi
}

# ---- step 0: the machine
echo "== step 0: the GPU and the packages"
python3 - >"$OUT/step0-gpu.log" 2>&1 <<'PY' || { echo "REFUSED: $(tail -1 "$OUT/step0-gpu.log")"; exit 2; }
import sys
import torch
if not torch.cuda.is_available():
    sys.exit("no CUDA GPU visible: this script runs the SM100 kernel on a B200 (compute capability 10.0)")
major, minor = torch.cuda.get_device_capability()
name = torch.cuda.get_device_name()
print(f"{name}: compute capability {major}.{minor}, {torch.cuda.get_device_properties(0).multi_processor_count} SMs")
if (major, minor) != (10, 0):
    sys.exit(f"{name} is compute capability {major}.{minor}, not 10.0: the SM100 kernel (sm_100a) cannot run "
             "here (on an H100 / H200 use benchmarks/release_check.sh)")
import cutlass  # noqa: F401
import cute_mla
print(f"cute_mla from {cute_mla.__file__}, torch {torch.__version__}, nvidia-cutlass-dsl {cutlass.__version__}")
PY
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader \
  >>"$OUT/step0-gpu.log" 2>&1 || true
sed 's/^/   /' "$OUT/step0-gpu.log"

# ---- step 1: does it run at all; both halves of O
if want 1; then
  echo "== step 1: smoke, b=1 s_q=1 h_q=64 one block, out[..., :256] and out[..., 256:] apart (V3.2, then V4)"
  pytest_step 1 600 "test_smoke_one_tile or test_v4_smoke_one_tile or test_v4_smoke_extra_pool" || fail 1 \
    "A hang (watchdog message): an mbarrier count or phase (docs/sm100.md, Pipelines); run the smoke case under
   compute-sanitizer --tool synccheck. 'out[..., 256:] (TMEM lanes 16-31) is wrong' with the lower half right:
   the M=64 interleaved O layout (the PV's D address at lane + 16). Both halves wrong: QK, softmax or P first.
   Only the V4 cases: its RoPE copy into K block 7, the scale ring, the index barrier's 164 arrivals."
fi

# ---- step 2: requests with no valid token, and requests with no tile
if want 2; then
  echo "== step 2: all-invalid rows, topk_length 0, empty block ranges (stale schedules)"
  pytest_step 2 600 "all_invalid_rows_and_zero_lengths or v4_lengths_zero or empty_range or stale or reused_schedule" \
    || fail 2 "NaN where 0 is expected: an invalid token's row not zero-filled by the TMA (coordinate -1) or,
   V4, a scale slot not zeroed. A hang or a wrong empty request: the empty-range skip (_Sched.request_tiles:
   every role must skip it; the softmax zeroes O in TMEM before the epilogue)."
fi

# ---- step 3: gather4 boxes
if want 3; then
  echo "== step 3: gather4 boxes (V3.2: 544 B of a 656-B row; V4: 448 B of a 576-B data row), padded page blocks of 3"
  pytest_step 3 600 "test_gather4_rows or non_power_of_two" || fail 3 \
    "Logits permuted within 4-token groups: the gather4 row order. Wrong everywhere: the box width or the row
   pitch of the 2-D table (rows_per_block = stride(0) / row bytes). Only with arbitrary scales: the scale words
   at bytes 512-527 of the V3.2 box."
fi

# ---- step 4: the whole GPU test file
if want 4; then
  echo "== step 4: every test of $GPU_TESTS (FlashMLA's sweep, split pieces, V4 and the extra pool, the public API)"
  pytest_step 4 3000 "" || fail 4 \
    "The first failure above names the case; its diagnose() table lists the wrong requests, tokens and heads
   (split pieces marked). See docs/sm100.md for what each part of the kernel owns."
  echo "== step 4, shared files: $SHARED_GPU_TESTS"
  GPU_TESTS=$SHARED_GPU_TESTS ALLOW_SKIPS=1 pytest_step 4-shared 2400 "" || fail 4 \
    "A shared GPU test on SM100: the combine (fp32 partials there), the device scheduler's sm_100a build, the V4
   sweep or the public API's paths (plans, schedules, CUDA graphs, the custom op) with the SM100 kernel."
fi

# ---- step 5: many launches under compute-sanitizer
if want 5; then
  echo "== step 5: launches in a loop under compute-sanitizer"
  SAN=$(command -v compute-sanitizer || true)
  # else the CUDA toolkit's, else one from the NVIDIA wheels (nvidia-cuda-sanitizer-api)
  for c in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer \
           $(python3 -c 'import glob, nvidia; print(*[f for p in nvidia.__path__ for f in glob.glob(p + "/**/compute-sanitizer", recursive=True)])' 2>/dev/null); do
    [ -z "$SAN" ] && [ -f "$c" ] && [ -x "$c" ] && SAN=$c
  done
  if [ -z "$SAN" ]; then
    echo "   compute-sanitizer not found (PATH, /usr/local/cuda, the nvidia-cuda-sanitizer-api wheel): step 5 skipped"
  else
    cat >"$OUT/step5-loop.py" <<'PY'
"""Launch a few SM100 cases many times (V3.2 and V4, split and not, invalid tokens, an empty range)."""
import sys

import torch

sys.path.insert(0, "tests")
import test_sm100_gpu as t  # noqa: E402
from cute_mla.scheduler import blocks_per_request, plan_splits_host  # noqa: E402
from cute_mla.testing import make_inputs  # noqa: E402

iters = int(sys.argv[1])
g = torch.Generator().manual_seed(0)
cases = [
    (make_inputs(4, 2, 64, 256, num_tokens=2048, page_block_size=61, with_topk_length=True, with_sink=True,
                 out_of_range_frac=0.05, all_invalid_rows=1, device="cuda", generator=g), False, None),
    (make_inputs(3, 1, 128, 2048, num_tokens=8192, page_block_size=64, with_sink=True, out_of_range_frac=0.05,
                 device="cuda", generator=g), True, None),
    (make_inputs(2, 1, 64, 512, num_tokens=2048, page_block_size=64, extra_topk=512, extra_num_tokens=1024,
                 extra_page_block_size=2, with_topk_length=True, with_extra_topk_length=True, d_qk=512,
                 device="cuda", generator=g), True, None),
]
stale = make_inputs(3, 1, 64, 2048, num_tokens=8192, page_block_size=64, with_topk_length=True, device="cuda",
                    generator=g)
stale.topk_length = torch.tensor([2048, 100, 2048], dtype=torch.int32, device="cuda")   # an empty piece
cases.append((stale, True, t._uploaded(plan_splits_host(blocks_per_request(2048, [2048] * 3), 4))))
for i in range(iters):
    for inp, split, schedule in cases:
        t.run_kernel(inp, split, schedule)
torch.cuda.synchronize()
print(f"{iters} x {len(cases)} launches done")
PY
    ITERS=${LOOP_ITERS:-20}
    for tool in memcheck racecheck synccheck; do
      n=$ITERS; [ "$tool" != memcheck ] && n=2
      log="$OUT/step5-$tool.log"
      echo "   compute-sanitizer --tool $tool, $n rounds of 4 cases (log: $log)"
      SM100_HANG_TIMEOUT_S=1200 timeout 1800 "$SAN" --tool "$tool" --error-exitcode 99 --print-limit 20 python3 "$OUT/step5-loop.py" "$n" \
        >"$log" 2>&1
      rc=$?
      tail -2 "$log"
      if [ $rc -ne 0 ]; then
        grep -E "=========" "$log" | head -12
        fail 5 "compute-sanitizer --tool $tool (exit $rc$([ $rc -eq 124 ] && echo ', timed out')): memcheck names
   the out-of-bounds access (a TMA box or an index read); racecheck a shared-memory hazard between roles (a
   missing barrier or fence.proxy.async); synccheck a named barrier / mbarrier misuse."
      fi
    done
  fi
fi

# ---- step 6: side by side with FlashMLA
if want 6 && [ "${SKIP_BENCH:-0}" != 1 ]; then
  echo "== step 6: benchmark, side by side with FlashMLA (V3.2 grid, then V4)"
  timeout 900 python3 -m benchmarks.bench_sparse_decode --json "$OUT/bench.json" >"$OUT/step6-bench.log" 2>&1 \
    || { tail -20 "$OUT/step6-bench.log"; fail 6 "the V3.2 benchmark (its log names the row)."; }
  tail -24 "$OUT/step6-bench.log"
  timeout 900 python3 -m benchmarks.bench_sparse_decode --v4 --out "$OUT/bench_v4.json" >"$OUT/step6-bench-v4.log" 2>&1 \
    || { tail -20 "$OUT/step6-bench-v4.log"; fail 6 "the V4 benchmark (its log names the row)."; }
  tail -24 "$OUT/step6-bench-v4.log"
fi

# ---- step 7: the sparse prefill kernel (flash_mla_sparse_fwd), then its benchmark
if want 7; then
  echo "== step 7: sparse prefill, tests/test_sparse_prefill_sm100_gpu.py (smoke first), then its benchmark"
  GPU_TESTS=tests/test_sparse_prefill_sm100_gpu.py pytest_step 7 600 "test_runs_on_sm100 or test_smoke_one_tile" \
    || fail 7 "The prefill kernel's first launch (docs/sm100.md, Sparse prefill). A hang: the k (gather4 tx bytes per
   stage, zero-filled rows included) or index pipeline counts. Wrong numbers with d_qk 576 only: the RoPE column
   block (block 8) of the gather; out[..., 256:] only: the lane-16 half of O (as the decode kernel's step 1)."
  GPU_TESTS=tests/test_sparse_prefill_sm100_gpu.py pytest_step 7-all 3000 "" || fail 7 \
    "The first failure names the case (FlashMLA's lists, NaN rows: an invalid position not zero-filled, out=, graph
   replay, s_q 70000)."
  if [ "${SKIP_BENCH:-0}" != 1 ]; then
    timeout 1800 python3 benchmarks/bench_sparse_prefill.py --quick >"$OUT/step7-bench.log" 2>&1 \
      || { tail -20 "$OUT/step7-bench.log"; fail 7 "the sparse prefill benchmark (its log names the row)."; }
    tail -16 "$OUT/step7-bench.log"
  fi
fi

echo
echo "All steps passed. Logs and results: $OUT"
