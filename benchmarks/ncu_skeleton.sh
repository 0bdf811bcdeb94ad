#!/usr/bin/env bash
# Where a latency-row decode kernel's time goes: Nsight Compute (warm caches, clocks as they run)
# of the skeleton (1x1x64, top-k 64, every index masked) and of the benchmark's 1x1x64 row, then
# per-kernel details and per-SASS stall samples as CSV under $OUT.
#   source .gpu/activate.sh && export PYTHONPATH=$PWD:$PYTHONPATH && bash benchmarks/ncu_skeleton.sh
set -u
OUT=${OUT:-artifacts}; mkdir -p "$OUT"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
for spec in ${SPECS:-skel:64:1.0 row:2048:0.2}; do
  IFS=: read -r name topk masked <<< "$spec"; set -- "$name" "$topk" "$masked"
  timeout 150 "$NCU" --clock-control none --cache-control none --profile-from-start off ${NCU_SET:---set full} \
      --import-source no -f -o "$OUT/$1" python3 benchmarks/ncu_profile.py --row 1,1,64 --topk "$2" --masked "$3" \
      > "$OUT/$1-ncu.log" 2>&1; tail -3 "$OUT/$1-ncu.log"
  "$NCU" --import "$OUT/$1.ncu-rep" --page details --csv > "$OUT/$1-details.csv" 2>&1
  "$NCU" --import "$OUT/$1.ncu-rep" --page source --csv --print-source sass > "$OUT/$1-source.csv" 2>&1
  ls -la "$OUT/$1"*
done
