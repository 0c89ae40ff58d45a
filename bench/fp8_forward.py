"""The FP8 forward against our bf16 forward, SDPA's cuDNN (bf16) and cuDNN's FP8 SDPA (the
nvidia-cudnn-frontend wheel, where it imports) in one run: TFLOP/s (FlashAttention's count) at
batch x seqlen = 16k tokens, 2048 / head_dim heads.

    python -m bench.fp8_forward [--head-dims 64 128 256] [--seqlens 1024 ... 16384] [--json out.json]

Each figure is the median over rounds of one CUDA-event pair around `--calls` back-to-back calls,
rotating three input sets: a call's host time overlaps the GPU's queue as it does in a model (our
FP8 call reads its descales from host arrays, so it never waits for the GPU). cuDNN's FP8 forward
writes O in e4m3 on Hopper (a bf16 O is Blackwell only: docs/fp8.md); ours writes bf16.
"""

from __future__ import annotations

# ruff: noqa: E402 - the imports follow the help guard, which must run first
from bench import help_first

help_first("fp8_forward", __doc__)

import argparse
import json
import sys

import cupy

import cupy_flash
from cupy_flash._dtypes import bfloat16
from cupy_flash.benchmark import flops as attention_flops
from cupy_flash.benchmark import make_sets, time_queued
from cupy_flash.fp8 import quantize_fp8

SETS = 3


def fp8_sets(batch, seqlen, heads, d, seed):
    rng = cupy.random.default_rng(seed)
    sets = []
    for _ in range(SETS):
        tensors = [quantize_fp8(rng.standard_normal((batch, seqlen, heads, d), dtype=cupy.float32)) for _ in range(3)]
        (q8, qd), (k8, kd), (v8, vd) = tensors
        sets.append((q8, k8, v8, *(cupy.asnumpy(x) for x in (qd, kd, vd))))
    return sets


def cudnn_fp8(declare):
    """A maker of cuDNN FP8 SDPA calls through the frontend, or the reason there is none:
    ``declare(cudnn, torch, g, dims, strides, causal)`` declares a graph's tensors and operation on
    the pygraph g (dims (batch, heads, seqlen, d), strides those of (batch, seqlen, heads, d)) and
    returns SETS data packs ({tensor: torch tensor}); the maker builds the plans around it."""
    try:
        import cudnn
        import torch
    except ImportError as error:
        return None, f"nvidia-cudnn-frontend not importable: {error}"
    handle = cudnn.create_handle()

    def make(batch, seqlen, heads, d, causal):
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
        g = cudnn.pygraph(io_data_type=cudnn.data_type.FP8_E4M3, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=handle)
        dims, strides = (batch, heads, seqlen, d), (seqlen * heads * d, d, heads * d, 1)
        packs = declare(cudnn, torch, g, dims, strides, causal)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        workspace = torch.empty(max(1, g.get_workspace_size()), dtype=torch.uint8, device="cuda")
        return lambda pack: g.execute(pack, workspace, handle=handle), packs

    return make, f"cudnn backend {cudnn.backend_version()}"


def cudnn_scalars(g, cudnn, names) -> dict:
    """The graph's float32 scalar tensors (descales, scales, amaxes) by name."""
    return {n: g.tensor(name=n, dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=cudnn.data_type.FLOAT) for n in names}


def _forward_graph(cudnn, torch, g, dims, strides, causal):
    """cuDNN's FP8 forward (sdpa_fp8): e4m3 q, k, v and O, the stats for a backward."""
    e4m3, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    batch, heads, seqlen, d = dims
    q, k, v = (g.tensor(name=n, dim=dims, stride=strides, data_type=e4m3) for n in "qkv")
    scales = cudnn_scalars(g, cudnn, ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o"))
    o, stats, amax_s, amax_o = g.sdpa_fp8(q=q, k=k, v=v, **scales, generate_stats=True, attn_scale=d ** -0.5,
                                          use_causal_mask=causal)
    o.set_output(True).set_dim(dims).set_stride(strides).set_data_type(e4m3)
    stats.set_output(True).set_dim((batch, heads, seqlen, 1)).set_stride((seqlen * heads, seqlen, 1, 1)).set_data_type(f32)
    for a in (amax_s, amax_o):
        a.set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(f32)
    packs = []
    for _ in range(SETS):
        data = {t: torch.randn(batch, seqlen, heads, d, device="cuda").to(torch.float8_e4m3fn) for t in (q, k, v)}
        data[o] = torch.empty(batch, seqlen, heads, d, device="cuda", dtype=torch.float8_e4m3fn)
        data[stats] = torch.empty(batch, heads, seqlen, 1, device="cuda")
        for t in list(scales.values()) + [amax_s, amax_o]:
            data[t] = torch.ones(1, 1, 1, 1, device="cuda")
        packs.append(data)
    return packs


def cudnn_fp8_forward():
    """A maker of cuDNN's FP8 SDPA forward calls through the frontend, or the reason there is none."""
    return cudnn_fp8(_forward_graph)


def sdpa_cudnn_bf16():
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as error:
        return None, f"torch not importable: {error}"

    def make(batch, seqlen, heads, d, causal):
        sets = [tuple(torch.randn(batch, heads, seqlen, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                for _ in range(SETS)]

        def call(s):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(*s, is_causal=causal)
        return call, sets

    return make, f"torch {torch.__version__}"


def time_peer(tflops: dict, name: str, make, flops: float, args, shape: tuple) -> None:
    """tflops[name]: a peer's calls (``make(*shape)``'s) queued and timed, or None where it refuses
    the shape (its reason printed)."""
    try:
        call, sets = make(*shape)
        tflops[name] = flops / time_queued(call, sets, args.calls, args.rounds) / 1e9
    except Exception as error:   # noqa: BLE001 - a peer that refuses a shape is reported
        tflops[name] = None
        d, seqlen, causal = shape[3], shape[1], shape[4]
        print(f"# {name} d={d} seqlen={seqlen} causal={causal}: {type(error).__name__}: {str(error)[:160]}", file=sys.stderr)


def table_row(first: tuple, tflops: dict, columns: tuple) -> str:
    """A markdown row: ``first``'s cells, then per column a TFLOP/s figure (a name) or a ratio (a pair)."""
    cells = [str(x) for x in first]
    for column in columns:
        if isinstance(column, tuple):
            a, b = column
            cells.append(f"{tflops[a] / tflops[b]:.2f}" if tflops.get(a) and tflops.get(b) else "-")
        else:
            cells.append(f"{tflops[column]:.0f}" if tflops.get(column) else "-")
    return "| " + " | ".join(cells) + " |"


def write_results(path, rows: list) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(dict(device=cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), rows=rows), f, indent=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fp8_forward", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    peers = {"cudnn_fp8": cudnn_fp8_forward(), "sdpa_cudnn_bf16": sdpa_cudnn_bf16()}
    for name, (_, note) in peers.items():
        print(f"# {name}: {note}", file=sys.stderr)
    rows = []
    print("| d | seqlen | causal | fp8 | bf16 | fp8 / bf16 | cuDNN fp8 | fp8 / cuDNN fp8 | SDPA cuDNN bf16 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for d in args.head_dims:
        heads = 2048 // d
        for seqlen in args.seqlens:
            batch = max(1, args.tokens // seqlen)
            fp8, bf16 = fp8_sets(batch, seqlen, heads, d, 0), make_sets(batch, seqlen, heads, d, bfloat16(), SETS, seed=1)
            for causal in (False, True):
                flops = attention_flops(batch, heads, seqlen, d, causal, "fwd")
                tflops = {}
                call = lambda s: cupy_flash.flash_forward(s[0], s[1], s[2], causal=causal,   # noqa: E731
                                                          q_descale=s[3], k_descale=s[4], v_descale=s[5])
                ms = time_queued(call, fp8, args.calls, args.rounds)
                tflops["fp8"] = flops / ms / 1e9
                ms = time_queued(lambda s: cupy_flash.flash_forward(*s[:3], causal=causal), bf16, args.calls, args.rounds)
                tflops["bf16"] = flops / ms / 1e9
                for name, (make, _) in peers.items():
                    if make is not None:
                        time_peer(tflops, name, make, flops, args, (batch, seqlen, heads, d, causal))
                print(table_row((d, seqlen, int(causal)), tflops, ("fp8", "bf16", ("fp8", "bf16"), "cudnn_fp8",
                                                                   ("fp8", "cudnn_fp8"), "sdpa_cudnn_bf16")), flush=True)
                rows.append(dict(head_dim=d, seqlen=seqlen, batch=batch, heads=heads, causal=causal, tflops=tflops))
    write_results(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
