# Sourced by the one-call device check scripts, after they set BUDGET (optional): it makes $OUT
# (default ./artifacts), sets XDIST (xdist.sh), names the V4 rows with a 1.2x target (V4_TARGET) and
# writes the GPU's name, driver and clocks to $OUT/gpu.txt.
# step NAME TIMEOUT CMD...: run CMD under TIMEOUT
# seconds (capped at what is left of BUDGET seconds of the script, when BUDGET is set; skipped
# under 20 s), its output in $OUT/NAME.log; print its exit status, wall time and the log's last
# TAIL lines (default 14) without warnings; return its exit status.
step() {
  local name=$1 t=$2; shift 2
  if [ -n "${BUDGET:-}" ]; then
    local left=$((BUDGET - SECONDS))
    [ "$t" -gt "$left" ] && t=$left
    if [ "$t" -lt 20 ]; then echo "== $name: skipped, ${left} s left"; return 1; fi
  fi
  local t0=$SECONDS
  timeout "$t" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc, $((SECONDS - t0)) s (timeout $t s; $*)"
  grep -v -e DEBUG -e Warning -e "^\s*for v in" -e "^\s*$" "$OUT/$name.log" | tail -"${TAIL:-14}"
  return $rc
}

OUT=${OUT:-artifacts}; mkdir -p "$OUT"
# the V4 rows (b,h,extra_topk) whose target is 1.2x FlashMLA: b >= 128 with an extra list
V4_TARGET="128,64,512;128,64,1024;512,64,512;512,64,1024;128,128,512;128,128,1024;512,128,512;512,128,1024"
source "$(dirname "${BASH_SOURCE[0]}")/xdist.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader | tee "$OUT/gpu.txt"
