#!/usr/bin/env bash
# One device call for the Hopper kernels: the draft backward's smoke check, compute-sanitizer
# memcheck / racecheck / synccheck on bench/sanitize_sm90.py (its kernels compiled first, outside
# the tool: compiling under racecheck ran past a 40 s limit), and the Hopper property tests (forward
# and the experimental backward). Logs go to $OUT; a summary is printed last.
# Usage on the device machine, from the repository root:  bash bench/device_check_sm90.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 CUPY_FLASH_QUIET=1
OUT=${OUT:-/tmp/cupy_flash_check}; mkdir -p "$OUT"
SECONDS=0
CUPY_FLASH_KERNELS=experimental timeout 120 python3 bench/smoke_sm90_backward.py > "$OUT/smoke_backward.txt" 2>&1
echo "smoke backward rc=$? ${SECONDS}s: $(tail -1 "$OUT/smoke_backward.txt")"
timeout 180 python3 bench/sanitize_sm90.py > "$OUT/sanitize_compile.txt" 2>&1   # fills the kernel cache
echo "sanitize workload (compile) rc=$? ${SECONDS}s"
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
for tool in memcheck racecheck synccheck; do
  timeout 150 "$sanitizer" --tool "$tool" --error-exitcode 9 python3 bench/sanitize_sm90.py > "$OUT/sanitizer_sm90_$tool.log" 2>&1
  echo "$tool rc=$? ${SECONDS}s: $(grep -h "ERROR SUMMARY\|RACECHECK SUMMARY" "$OUT/sanitizer_sm90_$tool.log" | tail -1)"
done
timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider tests/test_attention_gpu.py -k "hopper" \
  ${PYTEST_ARGS:-} > "$OUT/pytest_hopper.log" 2>&1
echo "hopper tests rc=$? ${SECONDS}s: $(tail -1 "$OUT/pytest_hopper.log")"
grep -E "^(FAILED|ERROR)" "$OUT/pytest_hopper.log" | head -20
