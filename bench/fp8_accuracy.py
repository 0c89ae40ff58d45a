"""FP8 attention accuracy study (CPU, NumPy float64): which products of the forward and the backward
can run in FP8 (e4m3 / e5m2), with which scales, and what the Hadamard rotation buys.

    python -m bench.fp8_accuracy                          # d 64 / 128 / 256, normal and outlier inputs
    python -m bench.fp8_accuracy --head-dims 128 --seqlen 2048 --seeds 3

Every scheme is emulated from the math: the operands of a product are rounded as its kernel would
hold them (cupy_flash.fp8.round_fp8: nearest even, satfinite; bf16 by ml_dtypes), the product and
everything else is exact (float64; the tensor cores accumulate in float32, ~1e-7 relative, far below
what is measured here). Errors are against float64 attention over the original inputs, so they
include the quantisation of q, k, v (what a user of FP8 inputs gets), as relative RMS (RMS of the
error over RMS of the exact values) and relative max (max error over max |exact|).

Inputs: standard normal q, k, v, dO; "outliers" adds 0.1% entries of magnitude 10 + |N(0, 1)| x 10
with random signs to q, k and v (FlashAttention-3's study). Non-causal, softmax scale 1/sqrt(d).
"""

from __future__ import annotations

import argparse
import math

import ml_dtypes
import numpy

from cupy_flash.fp8 import (
    P_SCALE,
    dequantize_fp8,
    hadamard_rotation,
    quantize_fp8,
    round_fp8,
    round_fp8_groups,
    round_fp8_tiles,
)


def bf16(x):
    return x.astype(numpy.float32).astype(ml_dtypes.bfloat16).astype(numpy.float64)


def inputs(seed, shape, outliers: bool):
    rng = numpy.random.default_rng(seed)
    q, k, v, do = (rng.standard_normal(shape) for _ in range(4))
    if outliers:
        for x in (q, k, v):
            mask = rng.random(shape) < 1e-3
            x[mask] = rng.choice((-1.0, 1.0), mask.sum()) * (10 + 10 * numpy.abs(rng.standard_normal(mask.sum())))
    return q, k, v, do


def quantized(x, scheme: str, rotation=None):
    """x (batch, seqlen, heads, d) as the kernel reads it, dequantised (float64; rotated if given)."""
    if scheme == "bf16":
        return bf16(x if rotation is None else x @ rotation)
    granularity = "tensor" if scheme == "fp8-tensor" else "head"
    x8, descale = quantize_fp8(x, granularity=granularity, rotation=rotation)
    return dequantize_fp8(x8, descale)


def attention(q, k, v, do, p_round, ds_round=None, dv_round=None, dp_round=None, dqk_round=None):
    """(o, dq, dk, dv) of attention with the P @ V operand P rounded by ``p_round`` (None: exact)
    and the backward's operands rounded by the other arguments: ``dv_round(P, dO)`` the operands
    of dV = P^T dO, ``dp_round(dO, V)`` those of dP = dO V^T, ``ds_round(dS)`` dS for dQ = dS K and
    dK = dS^T Q (with ``dqk_round(Q, K)`` their other operands). Layout (batch, heads, seqlen, d)."""
    scale = 1 / math.sqrt(q.shape[-1])
    s = scale * q @ k.swapaxes(-1, -2)
    m = s.max(axis=-1, keepdims=True)
    p = numpy.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)   # the row sum of the unrounded P, in float32 in the kernels
    o = (p_round(p) if p_round else p) @ v / l
    if do is None:
        return (o,)
    p = p / l
    delta = (do * o).sum(axis=-1, keepdims=True)
    p_dv, do_dv = dv_round(p, do) if dv_round else (p, do)
    dv = p_dv.swapaxes(-1, -2) @ do_dv
    do_dp, v_dp = dp_round(do, v) if dp_round else (do, v)
    ds = p * (do_dp @ v_dp.swapaxes(-1, -2) - delta)
    ds_q = ds_round(ds) if ds_round else ds
    q_op, k_op = dqk_round(q, k) if dqk_round else (q, k)
    return o, scale * ds_q @ k_op, scale * ds_q.swapaxes(-1, -2) @ q_op, dv


def errors(got, exact):
    rms = math.sqrt(numpy.mean((got - exact) ** 2)) / math.sqrt(numpy.mean(exact ** 2))
    return rms, numpy.abs(got - exact).max() / numpy.abs(exact).max()


def to_heads(x):
    return x.transpose(0, 2, 1, 3)


FORWARD = {
    "bf16 (inputs and P)": ("bf16", lambda p: bf16(p)),
    "fp8 per tensor, P e4m3": ("fp8-tensor", lambda p: round_fp8(p, "e4m3")),
    "fp8 per head, P e4m3": ("fp8-head", lambda p: round_fp8(p, "e4m3")),
    "fp8 per head, P x 2^8 e4m3": ("fp8-head", lambda p: round_fp8(p * P_SCALE, "e4m3") / P_SCALE),
}


def e4m3_head(x):
    return round_fp8_groups(x, "e4m3", axes=(2, 3))


BACKWARD = {   # with the forward of "fp8 per head, P x 2^8" (q, k, v in FP8)
    "bf16 operands (P, dO, dS in bf16)": dict(dv=lambda p, do: (bf16(p), bf16(do)), dp=lambda do, v: (bf16(do), v),
                                              ds=bf16),
    "dQ, dK in fp8 (dS e4m3 per 128 x 128 tile; P, dO bf16)": dict(
        dv=lambda p, do: (bf16(p), bf16(do)), dp=lambda do, v: (bf16(do), v), ds=lambda ds: round_fp8_tiles(ds, "e4m3")),
    "dV in fp8 (P x 2^8, dO per head e4m3)": dict(dv=lambda p, do: (round_fp8(p * P_SCALE, "e4m3") / P_SCALE, e4m3_head(do)),
                                                  dp=lambda do, v: (bf16(do), v), ds=bf16),
    "dV, dP in fp8 (dO per head e4m3)": dict(dv=lambda p, do: (round_fp8(p * P_SCALE, "e4m3") / P_SCALE, e4m3_head(do)),
                                             dp=lambda do, v: (e4m3_head(do), v), ds=bf16),
    "+ dQ, dK in fp8 (dS e4m3 per 128 x 128 tile)": dict(
        dv=lambda p, do: (round_fp8(p * P_SCALE, "e4m3") / P_SCALE, e4m3_head(do)),
        dp=lambda do, v: (e4m3_head(do), v), ds=lambda ds: round_fp8_tiles(ds, "e4m3")),
    "+ dQ, dK in fp8 (dS e5m2 per 128 x 128 tile)": dict(
        dv=lambda p, do: (round_fp8(p * P_SCALE, "e4m3") / P_SCALE, e4m3_head(do)),
        dp=lambda do, v: (e4m3_head(do), v), ds=lambda ds: round_fp8_tiles(ds, "e5m2")),
    "+ dQ, dK in fp8 (dS e4m3 per head)": dict(
        dv=lambda p, do: (round_fp8(p * P_SCALE, "e4m3") / P_SCALE, e4m3_head(do)),
        dp=lambda do, v: (e4m3_head(do), v), ds=lambda ds: round_fp8_groups(ds, "e4m3", axes=(2, 3))),
}


def study(head_dims, seqlen, heads, seeds):
    rows = []
    for d in head_dims:
        shape = (1, seqlen, heads, d)
        for outliers in (False, True):
            results: dict = {}
            for seed in range(seeds):
                q, k, v, do = inputs(seed, shape, outliers)
                exact = attention(*(to_heads(x) for x in (q, k, v, do)), None)
                for rotate in (False, True):
                    rotation = hadamard_rotation(d, seed=100 + seed) if rotate else None
                    for name, (scheme, p_round) in FORWARD.items():
                        qq, kk = (to_heads(quantized(x, scheme, rotation)) for x in (q, k))
                        vv = to_heads(quantized(v, scheme))
                        o = attention(qq, kk, vv, None, p_round)[0]
                        label = name + (" + Hadamard" if rotate else "")
                        own = attention(qq, kk, vv, None, None)[0]   # float64 over the inputs as read
                        results.setdefault(("o", label), []).append(errors(bf16(o), exact[0]) + errors(bf16(o), own))
                    if not rotate:
                        continue
                    # The backward with the chosen forward: q, k rotated (dq, dk rotate back with R^T)
                    qq, kk = (to_heads(quantized(x, "fp8-head", rotation)) for x in (q, k))
                    vv = to_heads(quantized(v, "fp8-head"))
                    own = [g for g in attention(qq, kk, vv, to_heads(do), None)[1:]]
                    own[0], own[1] = own[0] @ rotation.T, own[1] @ rotation.T
                    for name, rounding in BACKWARD.items():
                        _, dq, dk, dv = attention(qq, kk, vv, to_heads(do), lambda p: round_fp8(p * P_SCALE, "e4m3") / P_SCALE,
                                                  ds_round=rounding["ds"], dv_round=rounding["dv"], dp_round=rounding["dp"])
                        dq, dk = dq @ rotation.T, dk @ rotation.T
                        for grad, got, want, mine in zip(("dq", "dk", "dv"), (dq, dk, dv), exact[1:], own):
                            results.setdefault((grad, name), []).append(errors(bf16(got), want) + errors(bf16(got), mine))
                    # bf16 everywhere, for scale
                    qb, kb, vb, dob = (to_heads(bf16(x)) for x in (q, k, v, do))
                    _, dq, dk, dv = attention(qb, kb, vb, dob, bf16, ds_round=bf16,
                                              dv_round=lambda p, g: (bf16(p), g), dp_round=None)
                    own = attention(qb, kb, vb, dob, None)[1:]
                    for grad, got, want, mine in zip(("dq", "dk", "dv"), (dq, dk, dv), exact[1:], own):
                        results.setdefault((grad, "bf16 inputs, bf16 operands (today's kernels)"), []).append(
                            errors(bf16(got), want) + errors(bf16(got), mine))
            for (quantity, label), values in results.items():
                mean = [sum(v[i] for v in values) / len(values) for i in (0, 2)]
                worst = [max(v[i] for v in values) for i in (1, 3)]
                rows.append((d, "outliers" if outliers else "normal", quantity, label, mean[0], worst[0], mean[1], worst[1]))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.fp8_accuracy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128, 256])
    parser.add_argument("--seqlen", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--seeds", type=int, default=2)
    args = parser.parse_args(argv)
    rows = study(args.head_dims, args.seqlen, args.heads, args.seeds)
    print(f"seqlen {args.seqlen}, {args.heads} heads, batch 1, {args.seeds} seeds; relative RMS (mean over seeds) "
          "and relative max (worst); outputs rounded to bf16. 'original': against float64 over the original "
          "inputs; 'as read': against float64 over the inputs as the scheme reads them (dequantised), the "
          "accuracy rule's reference\n")
    print("| d | inputs | quantity | scheme | RMS, original | max, original | RMS, as read | max, as read |\n"
          "|---|---|---|---|---|---|---|---|")
    for d, kind, quantity, label, rms, worst, rms_read, worst_read in rows:
        print(f"| {d} | {kind} | {quantity} | {label} | {rms:.2e} | {worst:.2e} | {rms_read:.2e} | {worst_read:.2e} |")


if __name__ == "__main__":
    main()
