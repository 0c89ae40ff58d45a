#!/usr/bin/env bash
# Kernel patches against the working tree, in one device call: each patched copy's Hopper backward
# smoke check and deterministic tests (under timeouts: a wrong turn count hangs), then
# `python -m bench` of the working tree, of every patched copy, and of the working tree again, one
# after the other in the same call (their peers timed in each). Logs and the bench JSON go to $OUT; a summary is printed last.
# Usage on the device machine, from the repository root:
#   bash bench/ab_patch.sh <a>.patch [<b>.patch ...] [-- bench arguments]
# A patch file may name several patches joined by '+' (applied in order into one copy). Patches of
# work not landed live in git (`git show 2e2ac8f:docs/wip/README.md` lists the earlier ones).
# (default bench arguments: --modes bwd bwd_det --dtypes bf16 --head-dims 64 128 --seqlens 1024 4096 16384;
# BENCH="python3 bench/preprocess_rate.py" times that instead, in every tree, without arguments;
# CHECKS=0 skips the smoke check and the deterministic tests)
set -u
patches=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do patches+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#patches[@]} -gt 0 ] || { echo "usage: bash bench/ab_patch.sh a.patch [b.patch ...] [-- bench arguments]"; exit 2; }
BENCH=${BENCH:-python3 -m bench}
if [ "$BENCH" = "python3 -m bench" ]; then
  bench_args="${*:-"--modes bwd bwd_det --dtypes bf16 --head-dims 64 128 --seqlens 1024 4096 16384"} --kernels experimental"
  out_arg=--out   # the JSON of each tree's run under $OUT
else
  bench_args="$*" out_arg=
fi
export PYTHONUNBUFFERED=1 CUPY_FLASH_QUIET=1
OUT=${OUT:-/tmp/cupy_flash_ab}; mkdir -p "$OUT"
root=$(pwd)
SECONDS=0
trees=()
for spec in "${patches[@]}"; do
  name=$(basename "${spec//+/_}" .patch); tree=/tmp/cupy_flash_ab_$name
  rm -rf "$tree"; mkdir -p "$tree" "$OUT/$name"
  cp -r cupy_flash kernels_cu bench tests examples pyproject.toml "$tree"/
  applied=1
  IFS='+' read -ra parts <<< "$spec"
  for part in "${parts[@]}"; do
    [ "${part%.patch}" = "$part" ] && part=$part.patch
    (cd "$tree" && patch -p1 -s < "$root/$part") || { echo "$name: $part does not apply"; applied=0; }
  done
  [ $applied = 1 ] || continue
  trees+=("$name")
  if [ "${CHECKS:-1}" = 1 ]; then
    (cd "$tree" && PYTHONPATH=. CUPY_FLASH_KERNELS=experimental timeout 120 python3 bench/smoke_sm90_backward.py \
       > "$OUT/$name/smoke.txt" 2>&1); echo "$name smoke rc=$? ${SECONDS}s: $(tail -1 "$OUT/$name/smoke.txt")"
    (cd "$tree" && PYTHONPATH=. timeout 150 python3 -m pytest -x -q -p no:cacheprovider tests/test_attention_gpu.py \
       -k "deterministic and hopper" > "$OUT/$name/deterministic.txt" 2>&1)
    echo "$name deterministic tests rc=$? ${SECONDS}s: $(tail -1 "$OUT/$name/deterministic.txt")"
  fi
done
# The working tree is timed first and again last: in one call the same code measured -5% to +19%
# apart between trees run one after the other (docs/results/
# h100_sm90_bwd_det_key_split_pairs_interleaved_20261123.md), so a patch is read against both.
run_base() {   # $1: the directory under $OUT
  mkdir -p "$OUT/$1"
  # shellcheck disable=SC2086
  PYTHONPATH=. timeout 200 $BENCH $bench_args ${out_arg:+$out_arg "$OUT/$1"} > "$OUT/$1/bench.txt" 2>&1
  echo "bench (working tree, $1) rc=$? ${SECONDS}s"
}
run_base base_first
for name in "${trees[@]}"; do
  # shellcheck disable=SC2086
  (cd "/tmp/cupy_flash_ab_$name" && PYTHONPATH=. timeout 200 $BENCH $bench_args ${out_arg:+$out_arg "$OUT/$name"} \
     > "$OUT/$name/bench.txt" 2>&1); echo "bench $name rc=$? ${SECONDS}s"
done
run_base base
for name in base_first "${trees[@]}" base; do
  echo "== $name"; grep -E "^\| |ratio" "$OUT/$name/bench.txt" | cut -c1-160
done
