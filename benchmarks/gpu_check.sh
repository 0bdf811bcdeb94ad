#!/usr/bin/env bash
# One whole GPU check in one device call: GPU tests, the demo, then the benchmark against FlashMLA.
#   [TESTS="tests/x.py ..."] source .gpu/activate.sh && export PYTHONPATH=$PWD:$PYTHONPATH && CUTE_MLA_COMMIT=<sha> bash benchmarks/gpu_check.sh [TEST_TIMEOUT] [BENCH_ARGS...]
# Logs and the results JSON go to $OUT (or ./artifacts). SKIP_BENCH=1: the tests only (no demo, no
# benchmark). The SM90 GPU tests (tests/test_sm90_gpu.py, test_api_gpu.py, test_combine_gpu.py,
# test_scheduler_gpu.py) took 211 s together on the H200 in one process; with the benchmark (~250 s)
# they fit one call. The whole GPU suite took 344 s in one process.
set -u
OUT=${OUT:-artifacts}; mkdir -p "$OUT"
source "$(dirname "$0")/xdist.sh"
T=${1:-330}; shift || true
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader | tee "$OUT/gpu.txt"
echo "== GPU tests (timeout ${T}s; ${XDIST:-one process})"
timeout "$T" python3 -m pytest -q -rf -p no:cacheprovider --durations=8 $XDIST -m gpu ${TESTS:-tests} 2>&1 | tee "$OUT/tests.log" | grep -E "passed|failed|error|FAILED|ERROR|slowest|s call" | tail -40
if [ "${SKIP_BENCH:-0}" = 1 ]; then exit 0; fi
echo "== demo"
timeout 120 python3 -m cute_mla.cli demo 2>&1 | tee "$OUT/demo.log" | tail -14
echo "== benchmark"
timeout 300 python3 -m benchmarks.bench_sparse_decode --json "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log" | tail -18
