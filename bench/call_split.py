"""Where one call's time goes, ours and cuDNN's, at given shapes.

    python -m bench.call_split --mode bwd --head-dim 64 --seqlens 2048 4096 8192 --causal 1

bench.attention.time_calls times each call alone: events around one call, the GPU idle before it,
so a call's host time before its first launch counts. This splits that time. Per shape and library:

- per-call ms: time_calls' median;
- queued ms: per call, with 30 calls back to back (the host never the bottleneck);
- host us: perf_counter around the call, synchronised between calls.

For ours also each launch's GPU time and the gaps between launches, per call and queued. Events
around each launch add a few us of host time each, so the per-call total here runs a little above
time_calls'. Shapes as bench.attention's: batch * seqlen = --tokens, heads = --features / head_dim.
"""

from __future__ import annotations

import argparse
import statistics
import time

import cupy

import cupy_flash
from bench.attention import DTYPES, flops, make_sets, ours, time_calls, time_queued, torch_peer, torch_sets
from cupy_flash import backward as _backward
from cupy_flash import forward as _forward


class LaunchMarks:
    """Events around each of our kernel launches while active (the launch functions patched)."""

    def __init__(self):
        self.marks: list = []
        self.active = False
        for module in (_forward, _backward):
            module.launch_buffers = self._wrap(module.launch_buffers)

    def _wrap(self, launch):
        def marked(kernel, grid, threads, smem, arguments, **options):
            if not self.active:
                return launch(kernel, grid, threads, smem, arguments, **options)
            before, after = cupy.cuda.Event(), cupy.cuda.Event()
            before.record()
            launch(kernel, grid, threads, smem, arguments, **options)
            after.record()
            self.marks.append((before, after))
            return None
        return marked


def host_us(fn, sets, calls=40):
    """Median host microseconds of a call, the GPU idle before each."""
    for i in range(3):
        fn(sets[i % len(sets)])
    cupy.cuda.Device().synchronize()
    times = []
    for i in range(calls):
        started = time.perf_counter()
        fn(sets[i % len(sets)])
        times.append(time.perf_counter() - started)
        cupy.cuda.Device().synchronize()
    return 1e6 * statistics.median(times)


def queued_ms(fn, sets, calls=30):
    return time_queued(fn, sets, calls, warmup=1)


def launch_split(fn, sets, marks: LaunchMarks, calls=30) -> str:
    """Our launches' GPU us and the gaps between them: per call (the GPU idle before each) and queued."""
    ms = cupy.cuda.get_elapsed_time
    median = statistics.median
    marks.active = True
    try:
        for i in range(3):
            fn(sets[i % len(sets)])
        cupy.cuda.Device().synchronize()
        firsts, launches, gaps = [], [], []
        for i in range(calls):
            marks.marks.clear()
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            fn(sets[i % len(sets)])
            end.record()
            end.synchronize()
            firsts.append(ms(start, marks.marks[0][0]))
            launches.append([ms(a, b) for a, b in marks.marks])
            gaps.append([ms(marks.marks[j][1], marks.marks[j + 1][0]) for j in range(len(marks.marks) - 1)])
        marks.marks.clear()
        cupy.cuda.Device().synchronize()
        for i in range(calls):
            fn(sets[i % len(sets)])
        cupy.cuda.Device().synchronize()
        per = len(marks.marks) // calls
        queued = [median(ms(a, b) for a, b in marks.marks[j::per]) for j in range(per)]
    finally:
        marks.active = False
        marks.marks.clear()

    def columns(rows):
        return [1e3 * median(r[j] for r in rows) for j in range(len(rows[0]))]

    return (f"start -> first launch {1e3 * median(firsts):.1f} us; launches "
            + ", ".join(f"{x:.1f}" for x in columns(launches)) + " us; gaps "
            + ", ".join(f"{x:.1f}" for x in (columns(gaps) if gaps[0] else [])) + " us; queued launches "
            + ", ".join(f"{1e3 * x:.1f}" for x in queued) + " us")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", default="bwd", choices=["fwd", "bwd"])
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--seqlens", nargs="+", type=int, default=[2048, 4096, 8192])
    parser.add_argument("--causal", nargs="+", type=int, default=[1], choices=[0, 1])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--features", type=int, default=2048)
    args = parser.parse_args(argv)
    import torch
    from torch.nn.attention import SDPBackend

    marks = LaunchMarks()
    print("shape | who | TFLOP/s per call | per-call ms | queued ms | host us")
    for seqlen in args.seqlens:
        for causal in map(bool, args.causal):
            batch, heads = max(1, args.tokens // seqlen), args.features // args.head_dim
            sets = make_sets(batch, seqlen, heads, args.head_dim, DTYPES[args.dtype], 3)
            our_sets = sets if args.mode == "fwd" else [
                s + list(cupy_flash.flash_forward(s[0], s[1], s[2], causal=causal)) for s in sets]
            work = flops(batch, heads, seqlen, args.head_dim, causal, args.mode)
            label = f"{args.mode} {args.dtype} d={args.head_dim} N={seqlen} causal={int(causal)}"
            peer_sets = torch_sets(torch, sets, SDPBackend.CUDNN_ATTENTION, args.mode, causal)
            for who, fn, fn_sets in (("ours", ours(args.mode, causal), our_sets),
                                     ("cudnn", torch_peer(torch, SDPBackend.CUDNN_ATTENTION, args.mode, causal), peer_sets)):
                per_call = time_calls(fn, fn_sets)
                print(f"{label} | {who} | {work / per_call / 1e9:.0f} | {per_call:.3f} | {queued_ms(fn, fn_sets):.3f} | "
                      f"{host_us(fn, fn_sets):.1f}", flush=True)
                if who == "ours":
                    print(f"{label} | ours | {launch_split(fn, fn_sets, marks)}", flush=True)
            del sets, our_sets, peer_sets
            cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
