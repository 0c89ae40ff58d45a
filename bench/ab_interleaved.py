"""Kernel A/B in one process: the working tree (B) against another checkout (A), interleaved.

    git archive REV cupy_flash kernels_cu | tar -x -C /tmp/base      # A: any commit, or a patched copy
    python -m bench.ab_interleaved --base /tmp/base --modes fwd --head-dims 128 --seqlens 2048 16384

Each shape times A, B, B, A (``--rounds`` times) on the same inputs with per-call CUDA events and
rotated input sets (``bench.attention.time_calls``), and reports medians, TFLOP/s (FlashAttention's
FLOP count) and B/A. Trees timed one after the other in a call drifted apart by -5% to +19% on the
same code (docs/results/h100_sm90_bwd_det_key_split_pairs_interleaved_20261123.md); interleaved,
unchanged kernels read 0.95-1.03 (docs/results/h100_sm90_bwd_producer_unroll_dq_rows_interleaved_20261125.md),
so gains under ~3% need a second run. Both trees compile on first use (the kernel cache keys on the
source): fill it first on a cold machine. Peers are not timed here: tables against cuDNN come from
``python -m bench``.

B is the ``cupy_flash`` that ``import`` finds, which under ``python -m`` is the current directory's
before PYTHONPATH's: to time another copy as B, pass ``--tree DIR`` (a variant run with
PYTHONPATH=VARIANT from the repository root timed the working tree against itself, B/A 1.00
throughout: docs/decisions.md, "bench.ab_interleaved --tree DIR"). The files A and B come from are printed first.
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy

import cupy_flash
from bench.attention import DTYPES, flops, make_sets, time_calls
from bench.variants import load_baseline

AB_DTYPES = {**DTYPES, "fp32": numpy.float32}   # float32: the CUDA-core kernels (no peer to time)


def call(module, mode, causal):
    if mode == "fwd":
        return lambda s: module.flash_forward(s[0], s[1], s[2], causal=causal)
    deterministic = mode == "bwd_det"
    return lambda s: module.flash_backward(s[3], s[0], s[1], s[2], s[4], s[5], causal=causal, deterministic=deterministic)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="directory with another checkout's cupy_flash/ and kernels_cu/ (A)")
    parser.add_argument("--tree", help="the same for B (default: the cupy_flash that import finds)")
    parser.add_argument("--modes", nargs="+", default=["fwd"], choices=["fwd", "bwd", "bwd_det"])
    parser.add_argument("--dtypes", nargs="+", default=["bf16"], choices=sorted(AB_DTYPES))
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128, 256])
    parser.add_argument("--seqlens", nargs="+", type=int, default=[1024, 4096, 16384])
    parser.add_argument("--causal", nargs="+", type=int, default=[0, 1], choices=[0, 1])
    parser.add_argument("--rounds", type=int, default=1, help="A B B A rounds per shape")
    parser.add_argument("--tokens", type=int, default=16384, help="batch * seqlen")
    parser.add_argument("--features", type=int, default=2048, help="heads * head_dim")
    parser.add_argument("--out", help="JSON file for the rows")
    args = parser.parse_args(argv)
    base = load_baseline(args.base)
    tree = load_baseline(args.tree, "cupy_flash_tree") if args.tree else cupy_flash
    print(f"A: {base.__file__}\nB: {tree.__file__}", flush=True)
    rows = []
    for dtype in args.dtypes:
        for head_dim in args.head_dims:
            for seqlen in args.seqlens:
                for causal in args.causal:
                    batch, heads = max(1, args.tokens // seqlen), args.features // head_dim
                    sets = make_sets(batch, seqlen, heads, head_dim, AB_DTYPES[dtype], 3)
                    sets = [s + list(cupy_flash.flash_forward(s[0], s[1], s[2], causal=bool(causal))) for s in sets]
                    for mode in args.modes:
                        work = flops(batch, heads, seqlen, head_dim, causal, "bwd" if mode == "bwd_det" else mode)
                        times = {"A": [], "B": []}
                        for _ in range(args.rounds):
                            for which in ("A", "B", "B", "A"):
                                module = base if which == "A" else tree
                                times[which].append(time_calls(call(module, mode, bool(causal)), sets, min_calls=20,
                                                               max_calls=300, budget_s=0.4))
                        a, b = statistics.median(times["A"]), statistics.median(times["B"])
                        row = dict(dtype=dtype, head_dim=head_dim, seqlen=seqlen, causal=causal, mode=mode,
                                   a_tflops=work / a / 1e9, b_tflops=work / b / 1e9, b_over_a=a / b, a_ms=times["A"],
                                   b_ms=times["B"])
                        rows.append(row)
                        print(f"{mode:7s} {dtype} d={head_dim:3d} N={seqlen:5d} causal={causal}  A {row['a_tflops']:6.1f}  "
                              f"B {row['b_tflops']:6.1f} TFLOP/s  B/A {row['b_over_a']:.3f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
