#!/usr/bin/env bash
# The playground's GPU items in one device call: every GPU example and `cute-mla bench` on the
# issue's shape, each timed, each log in $OUT (or ./artifacts). The bench writes its results JSON
# next to --plot when matplotlib is missing (then `cute-mla bench --replot` draws it anywhere).
#   source .gpu/activate.sh && export PYTHONPATH=$PWD:$PYTHONPATH && bash benchmarks/playground_check.sh
set -u
source "$(dirname "$0")/step.sh"
step 06_a_first_kernel 120 python3 examples/06_a_first_kernel.py
step 04_try_a_variant 150 python3 examples/04_try_a_variant.py
step 02_drop_in 240 python3 examples/02_drop_in.py
step 05_decode_step_graph 180 python3 examples/05_decode_step_graph.py
step bench-1x8192x128 180 python3 -m cute_mla.cli bench --shape 1x8192x128 --vs flashmla --plot "$OUT/bench-1x8192x128.png"
