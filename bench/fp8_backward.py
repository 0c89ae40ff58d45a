"""The FP8 backward against our bf16 backward and cuDNN's FP8 SDPA backward (the
nvidia-cudnn-frontend wheel, where it imports; d = 128 only on Hopper) in one run: TFLOP/s
(FlashAttention's count: 2.5x the forward's) at batch x seqlen = 16k tokens, 2048 / head_dim heads.

    python -m bench.fp8_backward [--head-dims 64 128 256] [--seqlens 1024 ... 16384] [--json out.json]

Each figure is the median over rounds of one CUDA-event pair around `--calls` back-to-back calls,
rotating three input sets (bench.fp8_forward's method). Ours is flash_backward on e4m3 q, k, v with
host descales, given the FP8 forward's o and lse; cuDNN's takes e4m3 q, k, v, o, dO and writes e4m3
gradients, ours bf16 ones (docs/fp8.md, "The peer").
"""

from __future__ import annotations

# ruff: noqa: E402 - the imports follow the help guard, which must run first
from bench import help_first

help_first("fp8_backward", __doc__)

import argparse
import sys

import cupy

import cupy_flash
from bench.fp8_forward import SETS, cudnn_fp8, cudnn_scalars, fp8_sets, table_row, time_peer, write_results
from cupy_flash._dtypes import bfloat16
from cupy_flash.benchmark import flops as attention_flops
from cupy_flash.benchmark import make_sets, time_queued


def fp8_backward_sets(batch, seqlen, heads, d, causal, seed):
    """(q8, k8, v8, descales (host), do, o, lse) per set: o and lse from the FP8 forward."""
    rng = cupy.random.default_rng(seed + 7)
    sets = []
    for q8, k8, v8, qd, kd, vd in fp8_sets(batch, seqlen, heads, d, seed):
        descales = dict(q_descale=qd, k_descale=kd, v_descale=vd)
        o, lse = cupy_flash.flash_forward(q8, k8, v8, causal=causal, **descales)
        do = rng.standard_normal(o.shape, dtype=cupy.float32).astype(bfloat16())
        sets.append((q8, k8, v8, descales, do, o, lse))
    return sets


def bf16_backward_sets(batch, seqlen, heads, d, causal, seed):
    sets = []
    for q, k, v, do in make_sets(batch, seqlen, heads, d, bfloat16(), SETS, seed=seed):
        o, lse = cupy_flash.flash_forward(q, k, v, causal=causal)
        sets.append((do, q, k, v, o, lse))
    return sets


def _backward_graph(cudnn, torch, g, dims, strides, causal):
    """cuDNN's FP8 backward (sdpa_fp8_backward): e4m3 q, k, v, o, dO and gradients."""
    e4m3, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    batch, heads, seqlen, d = dims
    q, k, v, o, do = (g.tensor(name=n, dim=dims, stride=strides, data_type=e4m3) for n in ("q", "k", "v", "o", "dO"))
    stats = g.tensor(name="stats", dim=(batch, heads, seqlen, 1), stride=(seqlen * heads, seqlen, 1, 1), data_type=f32)
    scales = cudnn_scalars(g, cudnn, ("descale_q", "descale_k", "descale_v", "descale_o", "descale_dO", "descale_s",
                                      "descale_dP", "scale_s", "scale_dQ", "scale_dK", "scale_dV", "scale_dP"))
    dq, dk, dv, *amaxes = g.sdpa_fp8_backward(q=q, k=k, v=v, o=o, dO=do, stats=stats, **scales, attn_scale=d ** -0.5,
                                              use_causal_mask=causal)
    for t in (dq, dk, dv):
        t.set_output(True).set_dim(dims).set_stride(strides).set_data_type(e4m3)
    for a in amaxes:
        a.set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(f32)
    packs = []
    for _ in range(SETS):
        data = {t: torch.randn(batch, seqlen, heads, d, device="cuda").to(torch.float8_e4m3fn) for t in (q, k, v, o, do)}
        data[stats] = torch.randn(batch, heads, seqlen, 1, device="cuda") + 8
        for t in (dq, dk, dv):
            data[t] = torch.empty(batch, seqlen, heads, d, device="cuda", dtype=torch.float8_e4m3fn)
        for t in list(scales.values()) + amaxes:
            data[t] = torch.ones(1, 1, 1, 1, device="cuda")
        packs.append(data)
    return packs


def cudnn_fp8_backward():
    """A maker of cuDNN's FP8 SDPA backward calls through the frontend, or the reason there is none."""
    return cudnn_fp8(_backward_graph)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fp8_backward", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    make_cudnn, note = cudnn_fp8_backward()
    print(f"# cudnn_fp8: {note}", file=sys.stderr)
    rows = []
    print("| d | seqlen | causal | fp8 | bf16 | fp8 / bf16 | cuDNN fp8 | fp8 / cuDNN fp8 |")
    print("|---|---|---|---|---|---|---|---|")
    for d in args.head_dims:
        heads = 2048 // d
        for seqlen in args.seqlens:
            batch = max(1, args.tokens // seqlen)
            for causal in (False, True):
                flops = attention_flops(batch, heads, seqlen, d, causal, "bwd")
                tflops = {}
                fp8 = fp8_backward_sets(batch, seqlen, heads, d, causal, 0)
                ms = time_queued(lambda s: cupy_flash.flash_backward(s[4], s[0], s[1], s[2], s[5], s[6], causal=causal,
                                                                     **s[3]), fp8, args.calls, args.rounds)
                tflops["fp8"] = flops / ms / 1e9
                bf16 = bf16_backward_sets(batch, seqlen, heads, d, causal, 1)
                ms = time_queued(lambda s: cupy_flash.flash_backward(*s, causal=causal), bf16, args.calls, args.rounds)
                tflops["bf16"] = flops / ms / 1e9
                del fp8, bf16
                if make_cudnn is not None:
                    time_peer(tflops, "cudnn_fp8", make_cudnn, flops, args, (batch, seqlen, heads, d, causal))
                print(table_row((d, seqlen, int(causal)), tflops, ("fp8", "bf16", ("fp8", "bf16"), "cudnn_fp8",
                                                                   ("fp8", "cudnn_fp8"))), flush=True)
                rows.append(dict(head_dim=d, seqlen=seqlen, batch=batch, heads=heads, causal=causal, tflops=tflops))
    write_results(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
