#!/usr/bin/env bash
# A kernel patch against the working tree, in one device call: the patched copy's Hopper backward
# smoke check and deterministic tests (under timeouts: a wrong turn count hangs), then
# `python -m bench` of both trees one after the other in the same call (their peers timed in each).
# Logs and the bench JSON go to $OUT; a summary is printed last.
# Usage on the device machine, from the repository root:
#   bash bench/ab_patch.sh docs/wip/<name>.patch [bench arguments]
# (default bench arguments: --modes bwd bwd_det --dtypes bf16 --head-dims 64 128 --seqlens 1024 4096 16384;
# BENCH="python3 bench/preprocess_rate.py" times that instead, in both trees, without arguments)
set -u
patch_file=$(realpath "$1"); shift
BENCH=${BENCH:-python3 -m bench}
if [ "$BENCH" = "python3 -m bench" ]; then
  bench_args="${*:-"--modes bwd bwd_det --dtypes bf16 --head-dims 64 128 --seqlens 1024 4096 16384"} --kernels experimental"
  out_arg=--out   # the JSON of each tree's run under $OUT
else
  bench_args="$*" out_arg=
fi
export PYTHONUNBUFFERED=1 CUPY_FLASH_QUIET=1
OUT=${OUT:-/tmp/cupy_flash_ab}; mkdir -p "$OUT/patched" "$OUT/base"
patched=/tmp/cupy_flash_patched; rm -rf "$patched"; mkdir -p "$patched"
cp -r cupy_flash kernels_cu bench tests examples pyproject.toml "$patched"/
(cd "$patched" && patch -p1 -s < "$patch_file") || { echo "the patch does not apply"; exit 2; }
SECONDS=0
(cd "$patched" && PYTHONPATH=. CUPY_FLASH_KERNELS=experimental timeout 120 python3 bench/smoke_sm90_backward.py \
   > "$OUT/smoke.txt" 2>&1); echo "smoke (patched) rc=$? ${SECONDS}s: $(tail -1 "$OUT/smoke.txt")"
(cd "$patched" && PYTHONPATH=. timeout 150 python3 -m pytest -x -q -p no:cacheprovider tests/test_attention_gpu.py \
   -k "deterministic and hopper" > "$OUT/deterministic.txt" 2>&1); echo "deterministic tests (patched) rc=$? ${SECONDS}s: $(tail -1 "$OUT/deterministic.txt")"
# shellcheck disable=SC2086
(cd "$patched" && PYTHONPATH=. timeout 200 $BENCH $bench_args ${out_arg:+$out_arg "$OUT/patched"} \
   > "$OUT/bench_patched.txt" 2>&1); echo "bench (patched) rc=$? ${SECONDS}s"
# shellcheck disable=SC2086
PYTHONPATH=. timeout 200 $BENCH $bench_args ${out_arg:+$out_arg "$OUT/base"} > "$OUT/bench_base.txt" 2>&1
echo "bench (working tree) rc=$? ${SECONDS}s"
echo "== patched =="; grep -E "^\| |ratio" "$OUT/bench_patched.txt" | cut -c1-160
echo "== working tree =="; grep -E "^\| |ratio" "$OUT/bench_base.txt" | cut -c1-160
