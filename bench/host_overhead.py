"""Host time per call and queued kernel time, this tree against a baseline checkout.

    python -m bench.host_overhead --baseline DIR

bench/attention.py times each call alone (events around one call), so a call's Python time before
its launch counts as GPU time whenever the GPU waits for it; at 2k tokens that is a few percent.
This splits the two: host microseconds per call (a tiny problem, the GPU never the bottleneck) and
kernel milliseconds per call with 30 calls queued back to back (the host never the bottleneck),
plus a cProfile of this tree's host path.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import cupy

import cupy_flash
from bench.attention import DTYPES
from bench.variants import load_baseline, random


def host_us(fn, calls=2000):
    fn()
    cupy.cuda.Device().synchronize()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - started
    cupy.cuda.Device().synchronize()
    return 1e6 * elapsed / calls


def queued_ms(fn, calls=30, repeats=7):
    fn()
    results = []
    for _ in range(repeats):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        cupy.cuda.Device().synchronize()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        results.append(cupy.cuda.get_elapsed_time(start, end) / calls)
    return statistics.median(results)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True)
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    args = parser.parse_args()
    dtype = DTYPES[args.dtype]
    modules = {"new": cupy_flash, "old": load_baseline(args.baseline)}
    tiny = [random((1, 64, 1, 64), dtype, s) for s in range(4)]
    for name, module in modules.items():
        o, lse = module.flash_forward(*tiny[:3])
        fwd = host_us(lambda: module.flash_forward(*tiny[:3]))
        bwd = host_us(lambda: module.flash_backward(tiny[3], *tiny[:3], o, lse), calls=500)
        print(f"host | {name}: forward {fwd:6.1f} us/call, backward {bwd:6.1f} us/call", flush=True)
    for d in (64, 128):
        batch, seqlen, heads = 8, 2048, 2048 // d
        q, k, v, do = (random((batch, seqlen, heads, d), dtype, s) for s in range(4))
        for causal in (False, True):
            times = {}
            for name, module in modules.items():
                o, lse = module.flash_forward(q, k, v, causal=causal)
                times[name] = (queued_ms(lambda: module.flash_forward(q, k, v, causal=causal)),
                               queued_ms(lambda: module.flash_backward(do, q, k, v, o, lse, causal=causal)))
            print(f"queued | d={d} N={seqlen} causal={int(causal)}: kernel speed new/old fwd "
                  f"{times['old'][0] / times['new'][0]:.3f} bwd {times['old'][1] / times['new'][1]:.3f} "
                  f"(new {times['new'][0]:.3f} / {times['new'][1]:.3f} ms)", flush=True)
    o, lse = cupy_flash.flash_forward(*tiny[:3])
    for label, call in (("forward", lambda: cupy_flash.flash_forward(*tiny[:3])),
                        ("backward", lambda: cupy_flash.flash_backward(tiny[3], *tiny[:3], o, lse))):
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(300):
            call()
        profile.disable()
        print(f"profile | {label}, 300 calls")
        pstats.Stats(profile).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
