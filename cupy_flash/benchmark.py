"""The attention benchmark: cupy_flash against PyTorch SDPA's FlashAttention-2 and cuDNN backends.

    python -m cupy_flash bench            # FlashAttention's standard shapes, bf16 and fp16
    python -m cupy_flash bench --dtypes bf16 --head-dims 128 --seqlens 1024 4096 --causal 1
    python -m cupy_flash bench --modes fwd           # forward only
    python -m cupy_flash bench --portable            # also our portable kernels (CUPY_FLASH_KERNELS=portable)

(``python -m bench`` in the repository's root is the same command.)
Shapes as FlashAttention's benchmark: batch * seqlen = 16384 tokens, heads = 2048 / head_dim.
FLOPs as FlashAttention counts them: forward 4 * batch * heads * seqlen_q * seqlen_k * head_dim,
halved when causal; backward 2.5 x forward. With ``--head-dim-v`` (v's head_dim apart from q's and
k's), each product at its own width: forward 2 (head_dim + head_dim_v), backward 2 (3 head_dim + 2
head_dim_v) per (query, key) pair, as FlashAttention-3 counts them. Timing: CUDA events around each
call, warm-up calls excluded, median of many calls, several input sets rotated so no call finds its inputs in L2 from
the call before. The peers run in the same process on the same data (zero-copy through DLPack);
without PyTorch, ours alone is timed. With --rounds N each shape times ours and the peers N times,
the order reversed every other round (A B B A ...), each figure the median of its rounds: timed
once, one after the other, a single cell's ratio moved 3-10% between runs of the same kernels
(docs/performance.md). With --portable, our calls are also timed with the portable kernels
(mma.sync; the Hopper kernels off), so a Hopper GPU compares both paths in one run. The bf16
matrix-product rate (8192^3, PyTorch) is measured once as the ceiling. Results: a table on stdout,
JSON and (with matplotlib) a PNG plot under --out (default: bench/results in the repository's
root, else ./cupy_flash_bench).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import cupy
import ml_dtypes
import numpy

import cupy_flash
from cupy_flash.families import SETTINGS

DTYPES = {"bf16": ml_dtypes.bfloat16, "fp16": numpy.float16}
# bench/results where the repository's bench/ is in the working directory, else ./cupy_flash_bench.
RESULTS = os.path.join("bench", "results") if os.path.isfile(os.path.join("bench", "__main__.py")) else "cupy_flash_bench"


def event_milliseconds(call) -> float:
    """Milliseconds of one ``call()`` on the current stream, between two CUDA events."""
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    call()
    stop.record()
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop)


def flops(batch, heads, seqlen, head_dim, causal, mode, head_dim_v=None):
    """FLOPs of one call: S = Q K^T and dQ, dK at head_dim, O = P V, dP and dV at head_dim_v
    (default head_dim: forward 4 N^2 d, backward 2.5 x that)."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    pairs = 2.0 * batch * heads * seqlen * seqlen / (2 if causal else 1)
    forward, backward = pairs * (head_dim + head_dim_v), pairs * (3 * head_dim + 2 * head_dim_v)
    return {"fwd": forward, "bwd": backward, "bwd_det": backward, "fwd_bwd": forward + backward}[mode]


def time_calls(fn, input_sets, min_calls=10, max_calls=100, budget_s=0.6, warmup=3):
    """Median milliseconds of fn(inputs), rotating through input_sets; CUDA events per call."""
    for i in range(warmup):
        fn(input_sets[i % len(input_sets)])
    cupy.cuda.Device().synchronize()
    times = []
    started = time.perf_counter()
    while len(times) < max_calls and (len(times) < min_calls or time.perf_counter() - started < budget_s):
        inputs = input_sets[len(times) % len(input_sets)]
        times.append(event_milliseconds(lambda: fn(inputs)))
    return statistics.median(times)


def time_queued(fn, input_sets, calls: int = 10, rounds: int = 1, warmup: int = 3) -> float:
    """Median milliseconds per call over ``rounds`` CUDA-event pairs around ``calls`` back-to-back
    calls each, rotating through input_sets: a call's host time overlaps the GPU's queue, as in a
    model, where time_calls' event pair per call counts it."""
    for i in range(warmup):
        fn(input_sets[i % len(input_sets)])
    cupy.cuda.Device().synchronize()
    times = []
    for _ in range(rounds):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for i in range(calls):
            fn(input_sets[i % len(input_sets)])
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) / calls)
    return statistics.median(times)


def make_sets(batch, seqlen, heads, head_dim, dtype, count, seed=0, head_dim_v=None):
    rng = cupy.random.default_rng(seed)
    widths = (head_dim, head_dim, head_dim_v or head_dim, head_dim_v or head_dim)   # q, k, v, do
    sets = []
    for _ in range(count):
        arrays = [rng.standard_normal((batch, seqlen, heads, d), dtype=cupy.float32).astype(dtype) for d in widths]
        sets.append(arrays)
    return sets


def ours(mode, causal, kernels="auto"):
    """Our call for ``mode``, dispatched as CUPY_FLASH_KERNELS=``kernels`` would."""
    from cupy_flash.families import use_kernels

    call = _ours(mode, causal)

    def run(s):
        with use_kernels(kernels):
            return call(s)
    return run


def _ours(mode, causal):
    if mode == "fwd":
        return lambda s: cupy_flash.flash_forward(s[0], s[1], s[2], causal=causal)
    if mode in ("bwd", "bwd_det"):
        deterministic = mode == "bwd_det"
        return lambda s: cupy_flash.flash_backward(s[3], s[0], s[1], s[2], s[4], s[5], causal=causal,
                                                   deterministic=deterministic)

    def both(s):
        o, lse = cupy_flash.flash_forward(s[0], s[1], s[2], causal=causal)
        return cupy_flash.flash_backward(s[3], s[0], s[1], s[2], o, lse, causal=causal)
    return both


def torch_peer(torch, backend, mode, causal):
    from torch.nn.attention import sdpa_kernel
    mode = "bwd" if mode == "bwd_det" else mode   # peers are timed with their usual backward
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def forward(s):
        with sdpa_kernel(backend):
            return sdpa(s[0], s[1], s[2], is_causal=causal)

    if mode == "fwd":
        def run(s):
            with torch.no_grad():
                forward(s)
        return run
    if mode == "bwd":
        def run(s):   # s[4]: an output kept with its graph
            torch.autograd.grad(s[4], (s[0], s[1], s[2]), s[3], retain_graph=True)
        return run

    def run(s):
        out = forward(s)
        torch.autograd.grad(out, (s[0], s[1], s[2]), s[3])
    return run


def to_torch(torch, x):
    """Zero-copy PyTorch view of a CuPy array (bfloat16 through its bits if DLPack lacks it)."""
    if x.dtype == ml_dtypes.bfloat16:
        return torch.from_dlpack(x.view(cupy.uint16)).view(torch.bfloat16)
    return torch.from_dlpack(x)


def torch_sets(torch, sets, backend, mode, causal):
    """The same data as PyTorch tensors in SDPA's (batch, heads, seqlen, head_dim) layout (views)."""
    mode = "bwd" if mode == "bwd_det" else mode
    result = []
    for q, k, v, do in sets:
        tq, tk, tv, tdo = (to_torch(torch, x).transpose(1, 2) for x in (q, k, v, do))
        if mode != "fwd":
            tq, tk, tv = (x.detach().requires_grad_() for x in (tq, tk, tv))
        entry = [tq, tk, tv, tdo]
        if mode == "bwd":
            from torch.nn.attention import sdpa_kernel
            with sdpa_kernel(backend):
                entry.append(torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal))
        result.append(entry)
    return result


def matmul_rate(torch, size=8192) -> float:
    """bf16 TFLOP/s of a size^3 matrix product (PyTorch, cuBLAS): the tensor cores' ceiling."""
    a, b = (torch.randn(size, size, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ms = time_calls(lambda _: torch.matmul(a, b), [None])
    return 2.0 * size**3 / ms / 1e9


def run(args):
    try:
        import torch
        from torch.nn.attention import SDPBackend
        backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                    "efficient": SDPBackend.EFFICIENT_ATTENTION}
        peers = {name: backends[name] for name in args.peers}
    except Exception as error:   # benchmark ours alone
        print(f"PyTorch not available ({error}); timing cupy_flash only", file=sys.stderr)
        torch, peers = None, {}
    matmul = matmul_rate(torch) if torch is not None else None
    if matmul:
        print(f"bf16 matrix product 8192^3: {matmul:.0f} TFLOP/s", flush=True)

    rows = []
    device = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    shapes = [(dt, d, n, c) for dt in args.dtypes for d in args.head_dims for n in args.seqlens for c in args.causal]
    for index, (dtype_name, head_dim, seqlen, causal) in enumerate(shapes, 1):
        batch = max(1, args.tokens // seqlen)
        heads = args.features // head_dim
        head_dim_v = args.head_dim_v or head_dim
        sets = make_sets(batch, seqlen, heads, head_dim, DTYPES[dtype_name], args.sets, head_dim_v=head_dim_v)
        row = dict(dtype=dtype_name, head_dim=head_dim, seqlen=seqlen, causal=bool(causal), batch=batch, heads=heads,
                   head_dim_v=head_dim_v)
        for mode in args.modes:
            work = flops(batch, heads, seqlen, head_dim, causal, mode, head_dim_v)
            our_sets = sets
            if mode in ("bwd", "bwd_det"):
                our_sets = [s + list(cupy_flash.flash_forward(s[0], s[1], s[2], causal=bool(causal))) for s in sets]
            timed = [("ours", ours(mode, bool(causal), args.kernels), our_sets)]
            if args.portable:
                timed.append(("portable", ours(mode, bool(causal), "portable"), our_sets))
            for name, backend in peers.items():
                if mode == "bwd_det" and f"{name}_bwd" in row:   # peers run their usual backward: timed once
                    row[f"{name}_{mode}"] = row[f"{name}_bwd"]
                    continue
                try:
                    peer_sets = torch_sets(torch, sets, backend, mode, bool(causal))
                    timed.append((name, torch_peer(torch, backend, mode, bool(causal)), peer_sets))
                except Exception as error:   # a backend may not support a shape or dtype
                    row[f"{name}_{mode}"] = None
                    row[f"{name}_{mode}_error"] = f"{type(error).__name__}: {str(error)[:80]}"
            # Rounds alternate the order (A B, then B A, ...), so drift between the libraries'
            # turns (clocks, temperature) falls on both; each library's figure is its rounds' median.
            per_round = {name: [] for name, _, _ in timed}
            for r in range(args.rounds):
                for name, fn, fn_sets in (timed if r % 2 == 0 else timed[::-1]):
                    if name not in per_round:
                        continue
                    try:
                        per_round[name].append(work / time_calls(fn, fn_sets) / 1e9)
                    except Exception as error:   # a peer's failure is recorded; ours propagates
                        if name not in peers:
                            raise
                        row[f"{name}_{mode}"] = None
                        row[f"{name}_{mode}_error"] = f"{type(error).__name__}: {str(error)[:80]}"
                        del per_round[name]
            for name, values in per_round.items():
                row[f"{name}_{mode}"] = statistics.median(values)
                if args.rounds > 1:
                    row[f"{name}_{mode}_rounds"] = values
            del our_sets, timed
        rows.append(row)
        print(f"[{index}/{len(shapes)}] {format_row(row, args.modes, (['portable'] if args.portable else []) + list(peers))}",
              flush=True)
        del sets
        cupy.get_default_memory_pool().free_all_blocks()
    return dict(device=device, tokens=args.tokens, features=args.features, rows=rows,
                kernels=args.kernels, modes=args.modes, peers=(["portable"] if args.portable else []) + list(peers),
                torch=getattr(torch, "__version__", None), cupy=cupy.__version__, matmul_tflops=matmul)


def head_dims_label(row) -> str:
    """A row's head dim, or q's / v's where they differ ("192/128")."""
    d, d_v = row["head_dim"], row.get("head_dim_v", row["head_dim"])
    return f"{d}" if d_v == d else f"{d}/{d_v}"


def format_row(row, modes, peers):
    parts = [f"{row['dtype']} d={head_dims_label(row):>3} N={row['seqlen']:5d} causal={int(row['causal'])}"]
    for mode in modes:
        ours_tf = row[f"ours_{mode}"]
        text = f"{mode} ours {ours_tf:6.1f}"
        for name in peers:
            peer = row.get(f"{name}_{mode}")
            text += f" | {name} {peer:6.1f} ({ours_tf / peer:4.2f}x)" if peer else f" | {name}   n/a"
        parts.append(text)
    return "  ".join(parts)


def print_table(result):
    modes, peers = result["modes"], result["peers"]
    header = ["dtype", "d", "N", "causal"]
    for mode in modes:
        header += [f"ours {mode}"] + [f"{p} {mode}" for p in peers] + [f"vs {p}" for p in peers]
    print("\n| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in result["rows"]:
        cells = [row["dtype"], head_dims_label(row), str(row["seqlen"]), str(int(row["causal"]))]
        for mode in modes:
            ours_tf = row[f"ours_{mode}"]
            cells.append(f"{ours_tf:.0f}")
            cells += [f"{row[f'{p}_{mode}']:.0f}" if row.get(f"{p}_{mode}") else "n/a" for p in peers]
            cells += [f"{ours_tf / row[f'{p}_{mode}']:.2f}" if row.get(f"{p}_{mode}") else "n/a" for p in peers]
        print("| " + " | ".join(cells) + " |")
    print(f"\nTFLOP/s on {result['device']} (cupy {result['cupy']}, torch {result['torch']}); "
          "ratios are ours / peer, measured in this run" + ("; portable: our mma.sync kernels" if "portable" in peers else "")
          + (f"; bf16 matrix product {result['matmul_tflops']:.0f}" if result.get("matmul_tflops") else "") + ".")


def plot(result, path):
    """TFLOP/s against seqlen, one panel per (dtype, causal, mode) row and head_dim column."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows_by = sorted({(r["dtype"], r["causal"]) for r in result["rows"]})
    lines = [(dtype, causal, mode) for dtype, causal in rows_by for mode in result["modes"]]
    head_dims = sorted({r["head_dim"] for r in result["rows"]})
    fig, axes = plt.subplots(len(lines), len(head_dims), figsize=(4 * len(head_dims), 3 * len(lines)), squeeze=False)
    for i, (dtype, causal, mode) in enumerate(lines):
        for j, head_dim in enumerate(head_dims):
            rows = [r for r in result["rows"] if (r["dtype"], r["causal"], r["head_dim"]) == (dtype, causal, head_dim)]
            ax = axes[i][j]
            for name in ["ours"] + result["peers"]:
                ax.plot([r["seqlen"] for r in rows], [r.get(f"{name}_{mode}") or math.nan for r in rows],
                        marker="o", label="cupy_flash" if name == "ours" else name)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{mode} {dtype} d={head_dim}{' causal' if causal else ''}", fontsize=9)
            ax.set_xlabel("seqlen")
            ax.set_ylabel("TFLOP/s")
            ax.set_ylim(bottom=0)
            ax.legend(fontsize=7)
    fig.suptitle(f"{result['device']}: cupy_flash vs PyTorch SDPA backends", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def main(argv=None, prog="python -m cupy_flash bench"):
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"], choices=sorted(DTYPES))
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128, 256])
    parser.add_argument("--head-dim-v", type=int, default=0,
                        help="v's head_dim (o's), apart from q's and k's (0: each shape's head_dim)")
    parser.add_argument("--seqlens", nargs="+", type=int, default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--causal", nargs="+", type=int, default=[0, 1], choices=[0, 1])
    parser.add_argument("--modes", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd", "bwd_det", "fwd_bwd"],
                        help="bwd_det: our backward with deterministic=True (peers: their usual backward)")
    parser.add_argument("--tokens", type=int, default=16384, help="batch * seqlen")
    parser.add_argument("--features", type=int, default=2048, help="heads * head_dim")
    parser.add_argument("--sets", type=int, default=3, help="input sets rotated between calls")
    parser.add_argument("--rounds", type=int, default=1,
                        help="time ours and the peers this many times per shape, alternating their order (medians)")
    parser.add_argument("--peers", nargs="+", default=["flash", "cudnn"], choices=["flash", "cudnn", "efficient"],
                        help="SDPA backends timed beside ours (efficient: the one that takes head dims past 256)")
    parser.add_argument("--portable", action="store_true",
                        help="also time our portable kernels (CUPY_FLASH_KERNELS=portable) in the same run")
    parser.add_argument("--kernels", default="auto", choices=SETTINGS,
                        help="our calls' dispatch, as CUPY_FLASH_KERNELS (experimental: the opt-in kernels included)")
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args(argv)
    from cupy_flash._device import require_gpu

    require_gpu(prog)   # one line, exit status 1, where there is none
    result = run(args)
    print_table(result)
    os.makedirs(args.out, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    with open(os.path.join(args.out, f"attention-{stamp}.json"), "w") as f:
        json.dump(result, f, indent=1)
    png = plot(result, os.path.join(args.out, f"attention-{stamp}.png"))
    print(f"results: {args.out}/attention-{stamp}.json" + (f", {png}" if png else ""))
    return result


if __name__ == "__main__":
    main()
