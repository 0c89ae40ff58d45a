"""Variant benchmark: sliding window, GQA, and the plain path against a baseline build.

    python -m bench.variants                       # ragged varlen, bias, window and GQA tables
    python -m bench.variants --baseline DIR        # also: plain shapes, this tree vs DIR's cupy_flash

Window: causal attention at seqlen 16k with window (1024, 0) against the full causal mask (the
cost should follow the band, not seqlen^2); TFLOP/s count only the visible (query, key) pairs.
GQA 8:1: 16 query heads over 2 K/V heads against the same problem with K/V repeated to 16 heads
(MHA), and PyTorch SDPA's flash backend with enable_gqa where it runs.
Baseline: DIR holds another checkout's cupy_flash/ and kernels_cu/ (e.g. the commit before a
change); both are timed in this process on the same data, so the ratio is free of run-to-run drift.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import statistics
import sys

import cupy

import cupy_flash
from bench.attention import DTYPES, time_calls, to_torch


def band_pairs(seqlen_q, seqlen_k, causal, window):
    """Visible (query, key) pairs of one head, counted row by row."""
    left, right = window if window else (-1, -1)
    right = 0 if causal else right
    shift = seqlen_k - seqlen_q
    total = 0
    for i in range(seqlen_q):
        hi = seqlen_k - 1 if right < 0 else min(seqlen_k - 1, i + shift + right)
        lo = 0 if left < 0 else max(0, i + shift - left)
        total += max(0, hi - lo + 1)
    return total


def random(shape, dtype, seed):
    rng = cupy.random.default_rng(seed)
    return rng.standard_normal(shape, dtype=cupy.float32).astype(dtype)


def time_pair(module, q, k, v, do, **opts):
    """Median ms of forward and of backward."""
    o, lse = module.flash_forward(q, k, v, **opts)
    # At least 50 calls: a 2k call takes ~0.1 ms, and 10 of them drifted with the clocks.
    fwd = time_calls(lambda s: module.flash_forward(*s, **opts), [(q, k, v)], min_calls=50, max_calls=500)
    bwd = time_calls(lambda s: module.flash_backward(*s, **opts), [(do, q, k, v, o, lse)], min_calls=50, max_calls=500)
    return fwd, bwd


def window_table(dtype):
    rows = []
    batch, seqlen, heads, d = 1, 16384, 16, 128
    q, k, v, do = (random((batch, seqlen, heads, d), dtype, s) for s in range(4))
    for label, opts in (("causal, full", dict(causal=True)),
                        ("causal, window (1024, 0)", dict(causal=True, window_size=(1024, 0))),
                        ("window (512, 512)", dict(window_size=(512, 512))),
                        ("full", dict())):
        fwd, bwd = time_pair(cupy_flash, q, k, v, do, **opts)
        pairs = band_pairs(seqlen, seqlen, opts.get("causal", False), opts.get("window_size"))
        flop = 4.0 * batch * heads * pairs * d
        rows.append(dict(case=label, fwd_ms=fwd, bwd_ms=bwd, fwd_tflops=flop / fwd / 1e9,
                         bwd_tflops=2.5 * flop / bwd / 1e9))
        print(f"window | {label:26s} fwd {fwd:7.3f} ms {rows[-1]['fwd_tflops']:6.1f} TF/s | "
              f"bwd {bwd:7.3f} ms {rows[-1]['bwd_tflops']:6.1f} TF/s", flush=True)
    return rows


def gqa_table(dtype):
    rows = []
    batch, seqlen, heads, heads_kv, d = 4, 4096, 16, 2, 128
    q, do = (random((batch, seqlen, heads, d), dtype, s) for s in (0, 3))
    k, v = (random((batch, seqlen, heads_kv, d), dtype, s) for s in (1, 2))
    k_full, v_full = (cupy.repeat(x, heads // heads_kv, axis=2) for x in (k, v))
    for causal in (False, True):
        flop = 4.0 * batch * heads * seqlen * seqlen * d / (2 if causal else 1)
        gqa = time_pair(cupy_flash, q, k, v, do, causal=causal)
        mha = time_pair(cupy_flash, q, k_full, v_full, do, causal=causal)
        row = dict(causal=causal, gqa_fwd=flop / gqa[0] / 1e9, gqa_bwd=2.5 * flop / gqa[1] / 1e9,
                   mha_fwd=flop / mha[0] / 1e9, mha_bwd=2.5 * flop / mha[1] / 1e9)
        try:
            import torch
            from torch.nn.attention import SDPBackend, sdpa_kernel

            tq, tk, tv, tdo = (to_torch(torch, x).transpose(1, 2) for x in (q, k, v, do))
            tq, tk, tv = (x.detach().requires_grad_() for x in (tq, tk, tv))
            sdpa = torch.nn.functional.scaled_dot_product_attention
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                out = sdpa(tq, tk, tv, is_causal=causal, enable_gqa=True)

                def forward(_):
                    with torch.no_grad():
                        sdpa(tq, tk, tv, is_causal=causal, enable_gqa=True)

                ms_f = time_calls(forward, [None])
            ms_b = time_calls(lambda _: torch.autograd.grad(out, (tq, tk, tv), tdo, retain_graph=True), [None])
            row.update(flash_fwd=flop / ms_f / 1e9, flash_bwd=2.5 * flop / ms_b / 1e9)
        except Exception as error:   # SDPA's flash backend may not take enable_gqa
            row["flash_error"] = f"{type(error).__name__}: {str(error)[:100]}"
        rows.append(row)
        print("gqa 8:1 | " + " ".join(f"{n} {x:.1f}" if isinstance(x, float) else f"{n} {x}" for n, x in row.items()),
              flush=True)
    return rows


def ragged_table(dtype):
    """A packed batch of ragged sequences against a dense batch of the same number of tokens:
    TFLOP/s count each sequence's own (query, key) pairs, so equal TFLOP/s means no time is lost
    to the raggedness (the target: the ragged batch within 10% of the dense one). The padded
    dense batch (every sequence at the longest length) is what a framework without varlen runs."""
    rows = []
    heads, d = 16, 128
    lens = [4096, 512, 3000, 1200, 64, 2600, 777, 6000, 1800, 129, 3500, 2600]   # 26,378 tokens
    total = sum(lens)
    dense_batch, dense_len = 8, total // 8
    q = random((total, heads, d), dtype, 0)
    k, v, do = (random((total, heads, d), dtype, s) for s in (1, 2, 3))
    cu = cupy.asarray([0] + list(itertools.accumulate(lens)), dtype=cupy.int32)
    dense = [random((dense_batch, dense_len, heads, d), dtype, s) for s in range(4)]
    for causal in (False, True):
        div = 2 if causal else 1
        flop_ragged = sum(4.0 * heads * n * n * d / div for n in lens)
        flop_dense = 4.0 * dense_batch * heads * dense_len * dense_len * d / div
        ragged = time_pair(cupy_flash, q, k, v, do, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu,
                           max_seqlen_q=max(lens), max_seqlen_k=max(lens))
        flat = time_pair(cupy_flash, *dense, causal=causal)
        # The dense batch through the packed path (equal lengths): the varlen code's own cost, apart
        # from raggedness.
        cu_equal = cupy.arange(0, (dense_batch + 1) * dense_len, dense_len, dtype=cupy.int32)
        packed_dense = time_pair(cupy_flash, *(x.reshape(-1, heads, d) for x in dense), causal=causal,
                                 cu_seqlens_q=cu_equal, cu_seqlens_k=cu_equal, max_seqlen_q=dense_len,
                                 max_seqlen_k=dense_len)
        row = dict(causal=causal, tokens=total, lens=lens, dense=f"{dense_batch} x {dense_len}",
                   ragged_fwd_ms=ragged[0], ragged_bwd_ms=ragged[1], dense_fwd_ms=flat[0], dense_bwd_ms=flat[1],
                   ragged_fwd=flop_ragged / ragged[0] / 1e9, ragged_bwd=2.5 * flop_ragged / ragged[1] / 1e9,
                   dense_fwd=flop_dense / flat[0] / 1e9, dense_bwd=2.5 * flop_dense / flat[1] / 1e9)
        row["fwd_ratio"] = row["ragged_fwd"] / row["dense_fwd"]
        row["bwd_ratio"] = row["ragged_bwd"] / row["dense_bwd"]
        row["packed_dense_fwd_ratio"] = flat[0] / packed_dense[0]
        row["packed_dense_bwd_ratio"] = flat[1] / packed_dense[1]
        rows.append(row)
        print(f"ragged | causal={int(causal)} {total} tokens in {len(lens)} sequences: fwd {row['ragged_fwd']:.1f} TF/s "
              f"vs dense {dense_batch}x{dense_len} {row['dense_fwd']:.1f} ({row['fwd_ratio']:.2f}); bwd "
              f"{row['ragged_bwd']:.1f} vs {row['dense_bwd']:.1f} ({row['bwd_ratio']:.2f}); the dense batch packed: "
              f"fwd {row['packed_dense_fwd_ratio']:.2f}, bwd {row['packed_dense_bwd_ratio']:.2f} of its dense speed",
              flush=True)
    return rows


def bias_table(dtype):
    """The cost of an additive bias: a (seqlen_q, seqlen_k) float32 bias shared by batch and heads
    (read from L2 by every head) and a key padding mask (batch, 1, 1, seqlen_k), against no bias."""
    rows = []
    batch, seqlen, heads, d = 2, 4096, 16, 128
    q, k, v, do = (random((batch, seqlen, heads, d), dtype, s) for s in range(4))
    flop = 4.0 * batch * heads * seqlen * seqlen * d
    cases = (("none", None), ("(seqlen_q, seqlen_k)", random((seqlen, seqlen), cupy.float32, 5)),
             ("key mask (batch, 1, 1, seqlen_k)", cupy.zeros((batch, 1, 1, seqlen), cupy.float32)))
    for label, bias in cases:
        opts = {} if bias is None else dict(bias=bias)
        fwd, bwd = time_pair(cupy_flash, q, k, v, do, **opts)
        rows.append(dict(case=label, fwd_ms=fwd, bwd_ms=bwd, fwd_tflops=flop / fwd / 1e9, bwd_tflops=2.5 * flop / bwd / 1e9))
        print(f"bias | {label:34s} fwd {fwd:7.3f} ms {rows[-1]['fwd_tflops']:6.1f} TF/s | bwd {bwd:7.3f} ms "
              f"{rows[-1]['bwd_tflops']:6.1f} TF/s", flush=True)
    return rows


def load_baseline(directory, name="cupy_flash_baseline"):
    """Import DIR/cupy_flash under another name (its kernels from DIR/kernels_cu)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(directory, "cupy_flash", "__init__.py"),
                                                  submodule_search_locations=[os.path.join(directory, "cupy_flash")])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def baseline_table(dtype, baseline, seqlens=(2048, 16384), rounds=3):
    rows = []
    for d in (64, 128):
        for seqlen in seqlens:
            for causal in (False, True):
                batch, heads = max(1, 16384 // seqlen), 2048 // d
                q, k, v, do = (random((batch, seqlen, heads, d), dtype, s) for s in range(4))
                # Alternate old and new and take the median ratio: a lone pair of timings drifts
                # with clocks by more than the 2% this comparison is for.
                # The order flips every round (old-new, new-old, ...): whichever runs second after a
                # warm-up may meet lower clocks.
                ratios = []
                for round_ in range(rounds):
                    if round_ % 2 == 0:
                        old = time_pair(baseline, q, k, v, do, causal=causal)
                        new = time_pair(cupy_flash, q, k, v, do, causal=causal)
                    else:
                        new = time_pair(cupy_flash, q, k, v, do, causal=causal)
                        old = time_pair(baseline, q, k, v, do, causal=causal)
                    ratios.append((old[0] / new[0], old[1] / new[1]))
                fwd, bwd = (statistics.median(r[i] for r in ratios) for i in (0, 1))
                rows.append(dict(head_dim=d, seqlen=seqlen, causal=causal, fwd_new_over_old=fwd, bwd_new_over_old=bwd,
                                 rounds=ratios))
                print(f"plain vs baseline | d={d} N={seqlen} causal={int(causal)}: speed new/old fwd "
                      f"{fwd:.3f} bwd {bwd:.3f} (rounds: {', '.join(f'{a:.2f}/{b:.2f}' for a, b in ratios)})", flush=True)
    return rows


TABLES = {"ragged": ragged_table, "bias": bias_table, "window": window_table, "gqa": gqa_table}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--baseline", help="directory with another checkout's cupy_flash/ and kernels_cu/")
    parser.add_argument("--seqlens", nargs="+", type=int, default=[2048, 16384], help="plain shapes vs the baseline")
    parser.add_argument("--rounds", type=int, default=3, help="alternating old/new rounds per plain shape")
    parser.add_argument("--tables", nargs="*", default=list(TABLES), choices=list(TABLES),
                        help="variant tables to run (none: only the baseline comparison)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args()
    dtype = DTYPES[args.dtype]
    result = dict(device=cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), dtype=args.dtype)
    if args.baseline:
        result["baseline"] = baseline_table(dtype, load_baseline(args.baseline), args.seqlens, args.rounds)
    for name in args.tables:
        result[name] = TABLES[name](dtype)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"variants-{args.dtype}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"results: {path}")


if __name__ == "__main__":
    main()
