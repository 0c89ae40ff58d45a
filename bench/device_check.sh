#!/usr/bin/env bash
# One device call = one whole check: the test suite (GPU property tests included), compute-sanitizer
# memcheck and racecheck on a small forward + backward, and the smoke table. Logs go to $OUT.
# Usage on the device machine, from the repository root:  bash bench/device_check.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 CUPY_FLASH_QUIET=1
OUT=${OUT:-/tmp/cupy_flash_check}; mkdir -p "$OUT"
SECONDS=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"

timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -rs -p no:cacheprovider tests ${PYTEST_ARGS:-} > "$OUT/pytest.log" 2>&1
pytest_rc=$?
t_tests=$SECONDS

sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
for tool in memcheck racecheck; do
  timeout 240 "$sanitizer" --tool "$tool" --error-exitcode 9 python3 bench/sanitize.py > "$OUT/sanitizer_$tool.log" 2>&1
  echo "$tool rc=$?" >> "$OUT/sanitizer_rc.txt"
done

echo "== pytest (rc=$pytest_rc, ${t_tests}s) =="
sed -n '/hypothesis examples run per property/,$p' "$OUT/pytest.log" | grep -v "^SKIPPED" | tail -25
tail -1 "$OUT/pytest.log"
grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -20
echo "== compute-sanitizer =="
cat "$OUT/sanitizer_rc.txt"
grep -h "ERROR SUMMARY\|RACECHECK SUMMARY" "$OUT"/sanitizer_*.log
echo "total ${SECONDS}s"
