"""MLA decode A/B for docs/wip/mla_sm90_tma.patch: a base tree (A: BASE_DIR with its cupy_flash/ and
kernels_cu/) against the cupy_flash import finds (B), graphs of 24 calls, interleaved; then a split
sweep of B at batch 1. Usage: PYTHONPATH=. python docs/wip/mla_ab.py BASE_DIR [OUT.json] [quick]"""
import json
import sys

import cupy_flash
from bench.decode import MLA_D, MLA_D_V, MLA_HEADS, cupy_graph, interleaved_ms, mla_inputs
from bench.variants import load_baseline

base = load_baseline(sys.argv[1])
out = sys.argv[2] if len(sys.argv) > 2 else None
print("A:", base.__file__, "B:", cupy_flash.__file__, flush=True)


rows = []
quick = len(sys.argv) > 3 and sys.argv[3] == "quick"
shapes = [(1, 4096, 1), (1, 16384, 1), (1, 65536, 1), (16, 16384, 1), (16, 65536, 1), (64, 4096, 2), (128, 4096, 2)]
if quick:
    shapes = [(1, 65536, 1), (16, 16384, 1), (64, 4096, 2)]
print(f"{'batch':>5} {'cache':>6} {'s_q':>3} {'A us':>8} {'B us':>8} {'B/A':>5} {'A TF':>6} {'B TF':>6}", flush=True)
for batch, length, seqlen_q in shapes:
    copies = max(1, min(8, -(-(256 * 2**20) // (batch * length * MLA_D * 2))))
    q, caches, options = mla_inputs(batch, length, seqlen_q, copies)
    replays = {"A": cupy_graph(lambda k: base.flash_decode(q, k, k[..., :MLA_D_V], **options), caches),
               "B": cupy_graph(lambda k: cupy_flash.flash_decode(q, k, k[..., :MLA_D_V], **options), caches)}
    times = interleaved_ms(replays)
    flops = 2 * batch * seqlen_q * MLA_HEADS * length * (MLA_D + MLA_D_V)
    row = dict(batch=batch, cache_len=length, seqlen_q=seqlen_q, a_us=1e3 * times["A"], b_us=1e3 * times["B"],
               a_tflops=flops / times["A"] / 1e9, b_tflops=flops / times["B"] / 1e9)
    rows.append(row)
    print(f"{batch:5d} {length:6d} {seqlen_q:3d} {row['a_us']:8.1f} {row['b_us']:8.1f} {times['B'] / times['A']:5.2f} "
          f"{row['a_tflops']:6.0f} {row['b_tflops']:6.0f}", flush=True)
    del replays, caches

if quick:
    sys.exit(0)
print("split sweep (B), us", flush=True)
splits = [None, 4, 8, 16, 32, 64]
for batch, length in ((1, 4096), (1, 16384), (1, 65536), (4, 16384)):
    q, caches, options = mla_inputs(batch, length, 1, 4)
    replays = {n: cupy_graph(lambda k, n=n: cupy_flash.flash_decode(q, k, k[..., :MLA_D_V], num_splits=n, **options), caches)
               for n in splits}
    times = interleaved_ms(replays)
    row = dict(batch=batch, cache_len=length, sweep={str(n): 1e3 * t for n, t in times.items()})
    rows.append(row)
    print(batch, length, " ".join(f"{n}:{1e3 * t:.1f}" for n, t in times.items()), flush=True)
    del replays, caches
if out:
    json.dump(rows, open(out, "w"), indent=1)
