#!/usr/bin/env bash
# A release's whole GPU check in one device call of at most BUDGET (590) s, most important first,
# each step as far as the call's time allows. The steps (STEPS, default "tests v4 v32"):
#   tests     the GPU suite (TESTS="tests/x.py ..." narrows it), in WORKERS (8) processes sharing the
#             GPU when pytest-xdist is importable; TESTS_S (330) s: it outlasted 220 s with 8 workers
#             on an H100
#   v4        the V4 grid against FlashMLA (README's V4 table, 5 draws a row), V4_S (150) s
#   v32       the V3.2 grid against FlashMLA (README's table; V32_ROWS: all, quick (~15 s) or
#             "b,s_q,h;..."), V32_S s (default: the time left)
#   prefill   the sparse prefill table against FlashMLA (idle-GPU call, GPU and sustained time, two
#             runs; README's prefill table), PREFILL_S (300) s, its JSON and markdown in $OUT
#   demo      cute-mla demo
#   examples  every GPU example, then `cute-mla bench --shape 1x8192x128 --vs flashmla --plot`
#             (the playground; the bench writes its results JSON next to the plot when matplotlib
#             is missing, and `cute-mla bench --replot` draws it anywhere)
# e.g. STEPS="examples" for the playground alone, STEPS="tests demo v32" for tests, demo and grid,
# STEPS="tests prefill" for the suite and the prefill table.
# Each step's log lands in $OUT/<step>.log (OUT default ./artifacts), the results JSON in
# $OUT/v4.json and $OUT/v32.json, the GPU's name, driver and clocks in $OUT/gpu.txt; each step
# prints its exit status, wall time and its log's last lines; the script exits 1 if any step
# failed or was skipped for time.
#   source .gpu/activate.sh && export PYTHONPATH=$PWD:$PYTHONPATH CUTE_MLA_COMMIT=<sha> && bash benchmarks/release_check.sh
set -u
BUDGET=${BUDGET:-590}
STEPS=" ${STEPS:-tests v4 v32} "
OUT=${OUT:-artifacts}; mkdir -p "$OUT"
XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${WORKERS:-8}")
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader \
  | tee "$OUT/gpu.txt"

# step NAME TIMEOUT CMD...: CMD under TIMEOUT seconds, capped at what is left of BUDGET (skipped
# under 20 s), its output in $OUT/NAME.log; prints its exit status, wall time and the log's last
# TAIL (14) lines without warnings; returns CMD's exit status.
step() {
  local name=$1 t=$2; shift 2
  local left=$((BUDGET - SECONDS))
  [ "$t" -gt "$left" ] && t=$left
  if [ "$t" -lt 20 ]; then echo "== $name: skipped, ${left} s left"; return 1; fi
  local t0=$SECONDS
  timeout "$t" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc, $((SECONDS - t0)) s (timeout $t s; $*)"
  grep -v -e DEBUG -e Warning -e "^\s*for v in" -e "^\s*$" "$OUT/$name.log" | tail -"${TAIL:-14}"
  return $rc
}
want() { [[ "$STEPS" == *" $1 "* ]]; }
FAILED=""
run() { step "$@" || FAILED="$FAILED $1"; }   # run NAME TIMEOUT CMD...: step, its failure remembered

# shellcheck disable=SC2086  # XDIST and TESTS are word lists
want tests && TAIL=12 run tests "${TESTS_S:-330}" python3 -m pytest -q -rf -p no:cacheprovider --durations=8 $XDIST \
  -m gpu ${TESTS:-tests}
want v4 && TAIL=30 run v4 "${V4_S:-150}" python3 -m benchmarks.bench_sparse_decode --v4 --draws 5 --out "$OUT/v4.json"
want v32 && TAIL=40 run v32 "${V32_S:-$((BUDGET - SECONDS))}" python3 -m benchmarks.bench_sparse_decode --rows "${V32_ROWS:-all}" \
  --json "$OUT/v32.json"
want prefill && TAIL=40 run prefill "${PREFILL_S:-300}" python3 benchmarks/bench_sparse_prefill.py --iters 5 --warmup 2 \
  --warmup-s 0.5 --repeat 2 --sustained 1 --save "$OUT"
want demo && run demo 120 python3 -m cute_mla.cli demo
if want examples; then
  run 06_a_first_kernel 120 python3 examples/06_a_first_kernel.py
  run 04_try_a_variant 150 python3 examples/04_try_a_variant.py
  run 02_drop_in 240 python3 examples/02_drop_in.py
  run 05_decode_step_graph 180 python3 examples/05_decode_step_graph.py
  run bench-1x8192x128 180 python3 -m cute_mla.cli bench --shape 1x8192x128 --vs flashmla \
    --plot "$OUT/bench-1x8192x128.png"
fi
[ -z "$FAILED" ] || { echo "== failed or skipped:$FAILED"; exit 1; }
