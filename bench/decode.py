"""Decoding benchmark: one new query token against a K/V cache (bf16, d=128, 32 query heads, or --heads).

    python -m bench.decode [--out DIR] [--lengths 4096 16384 ...] [--batches 1 8 64] [--heads 64]
    python -m bench.decode --sweep auto 8 16 32 64 128 --batches 1 [--lengths ...]
    python -m bench.decode --mla [--batches 1 16 64 128] [--lengths 4096 16384 65536]

Decoding is memory-bound, so the figure is bandwidth: bytes of K and V read per second, against
the device's copy rate measured in the same run (a 1 GiB device-to-device copy: bytes read plus
bytes written per second). For each (batch, cache length, GQA 8:1 or 1:1): flash_decode on a
contiguous cache, flash_decode on a paged cache (pages of 256 keys, shuffled), flash_decode on an
FP8 cache of the same shape (e4m3, half the bytes; its speed-up over the bf16 cache is the time
ratio), and PyTorch SDPA's flash backend on the same tensors (seqlen_q = 1) where it runs. Caches rotate among enough copies
to exceed the L2 cache (so no call reads a cache its predecessor left in L2).

With --mla, DeepSeek's MLA decoding instead: 128 query heads over one latent K/V head of 576
columns in pages of 64 (shuffled), v the view of each row's first 512 (as FlashMLA reads it), one
new token (two, causal, from batch 64: speculative decoding, the compute-bound shapes), from a
bf16 and from an e4m3 cache, with v a separate bf16 array (the general decode kernel, where the
MLA kernels do not apply; up to MLA_SEPARATE_V_KEYS cached keys in all), and the bf16 and e4m3
calls under CUPY_FLASH_KERNELS=portable (the mma.sync MLA kernel, where the Hopper one runs them
otherwise: "x mma" and "x" are its time over the default call's);
GB/s counts the latent cache's bytes once, TFLOP/s FlashAttention's count (2 x rows x keys x
(576 + 512)).

A small decode call reads a few MB in microseconds, far less than one call's Python time, so calls
launched one by one measure the host. Both sides are therefore timed as a generation loop runs
them: captured in a CUDA graph (ours with cupy.cuda.Graph, PyTorch's with torch.cuda.CUDAGraph), 24
calls per graph over the rotating caches; CUDA events around each replay, warm-up excluded, the
median replay over the calls in it. A shape's graphs are timed in turn, three rounds, and each
keeps its median round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import cupy

import cupy_flash
from bench.attention import time_calls, to_torch

HEADS, D = 32, 128
ROTATE_BYTES = 256 * 2**20          # several times the H100's 50 MB L2
MEMORY_LIMIT = 40 * 2**30           # skip shapes whose caches (all rotations) exceed this


def copy_rate_gbs(rounds: int = 3) -> float:
    """Bytes read plus written per second by a 1 GiB device copy: the fastest of ``rounds`` medians
    (the yardstick errs high, never flattering us: one median once read 2866 GB/s where other runs
    read 2978-2983)."""
    src = cupy.empty(2**30, dtype=cupy.uint8)
    dst = cupy.empty_like(src)
    ms = min(time_calls(lambda _: dst.__setitem__(Ellipsis, src), [None], min_calls=20, max_calls=50)
             for _ in range(rounds))
    return 2 * src.nbytes / ms / 1e6


def rotating_copies(size: int) -> int | None:
    """Copies of a shape's caches (``size`` bytes each) to rotate through, enough to exceed
    ROTATE_BYTES (at most 8); None where they would exceed MEMORY_LIMIT (the shape is skipped)."""
    copies = max(1, min(8, -(-ROTATE_BYTES // size)))
    return None if size * copies > MEMORY_LIMIT else copies


def write_result(result: dict, out: str, name: str, quiet: bool = False) -> None:
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, name)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    if not quiet:
        print(f"results: {path}")


CALLS_PER_GRAPH = 24
# Each shape's graphs are timed in turn, ROUNDS times, and each keeps its median round: a drift of
# clocks or temperature during a shape then touches every side alike. (Timed one after the other,
# 1:1 batch 1 at 4k read 1975 GB/s timed first, and 2218 in a later run that interleaved.)
ROUNDS = 3


def cupy_graph(call, inputs):
    """Replay function of call(inputs[i % len]) captured CALLS_PER_GRAPH times in one graph."""
    cupy.cuda.Device().synchronize()   # inputs were made on the default stream
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for i in range(CALLS_PER_GRAPH):   # compile and warm the pool on the capture stream
            call(inputs[i % len(inputs)])
        stream.synchronize()
        stream.begin_capture()
        keep = [call(inputs[i % len(inputs)]) for i in range(CALLS_PER_GRAPH)]
        graph = stream.end_capture()
    return lambda keep=keep: graph.launch()   # the outputs live as long as the replay function


def torch_graph(torch, call, inputs):
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(3):
            call(inputs[i % len(inputs)])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        keep = [call(inputs[i % len(inputs)]) for i in range(CALLS_PER_GRAPH)]
    torch.cuda.synchronize()
    return lambda keep=keep: graph.replay()


def interleaved_ms(replays: dict) -> dict:
    """Milliseconds per call of each graph's replay function: ROUNDS rounds over all of them (CUDA
    events per replay, warm-up excluded, median replay of each round), the median round."""
    rounds = {name: [] for name in replays}
    for _ in range(ROUNDS):
        for name, replay in replays.items():
            rounds[name].append(time_calls(lambda _, replay=replay: replay(), [None], min_calls=10, max_calls=30,
                                           budget_s=0.25))
    return {name: statistics.median(ms) / CALLS_PER_GRAPH for name, ms in rounds.items()}


def random_bf16(shape, seed):
    import ml_dtypes

    return cupy.random.default_rng(seed).standard_normal(shape, dtype=cupy.float32).astype(ml_dtypes.bfloat16)


def decode_case(batch, length, heads_kv, copies):
    """(q, rotating (k, v) caches, cache_seqlens, K/V bytes per call, the row's first fields)."""
    kv_bytes = 2 * batch * length * heads_kv * D * 2
    q = random_bf16((batch, 1, HEADS, D), 0)
    caches = [(random_bf16((batch, length, heads_kv, D), 2 * i + 1), random_bf16((batch, length, heads_kv, D), 2 * i + 2))
              for i in range(copies)]
    lengths = cupy.full((batch,), length, dtype=cupy.int32)
    return q, caches, lengths, kv_bytes, dict(batch=batch, cache_len=length, gqa=f"{HEADS // heads_kv}:1")


def one_shape(batch, length, heads_kv, copies):
    """Rows of one (batch, length, heads_kv): K/V GB/s of each implementation."""
    import numpy

    group = HEADS // heads_kv
    q, caches, lengths, kv_bytes, row = decode_case(batch, length, heads_kv, copies)
    row["kv_mb"] = kv_bytes / 2**20
    replays = {"ours": cupy_graph(lambda c: cupy_flash.flash_decode(q, c[0], c[1], cache_seqlens=lengths), caches)}
    # Paged: the same data in pages of 256 keys, placed in shuffled order.
    page = 256
    pages_per = length // page
    order = numpy.random.default_rng(0).permutation(batch * pages_per).astype(numpy.int32)
    table = cupy.asarray(order.reshape(batch, pages_per))
    paged = []
    for k, v in caches:
        k_pages, v_pages = (cupy.empty((batch * pages_per, page, heads_kv, D), dtype=k.dtype) for _ in range(2))
        for dst, src in ((k_pages, k), (v_pages, v)):
            dst.view(cupy.uint16)[cupy.asarray(order)] = src.view(cupy.uint16).reshape(batch * pages_per, page, heads_kv, D)
        paged.append((k_pages, v_pages))
    replays["ours_paged"] = cupy_graph(
        lambda c: cupy_flash.flash_decode(q, c[0], c[1], cache_seqlens=lengths, block_table=table), paged)
    # FP8: random e4m3 bits (no NaN codes) with a descale per (sequence, K/V head).
    rng = cupy.random.default_rng(7)
    fp8 = [tuple(rng.integers(0, 0x7e, k.shape, dtype=cupy.int32).astype(cupy.uint8) for _ in range(2)) for k, _ in caches]
    descale = cupy.full((batch, heads_kv), 0.01, dtype=cupy.float32)
    replays["ours_fp8"] = cupy_graph(lambda c: cupy_flash.flash_decode(q, c[0], c[1], cache_seqlens=lengths,
                                                                       k_descale=descale, v_descale=descale), fp8)
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        tq = to_torch(torch, q).transpose(1, 2)
        tcaches = [tuple(to_torch(torch, x).transpose(1, 2) for x in c) for c in caches]
        sdpa = torch.nn.functional.scaled_dot_product_attention
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.no_grad():
            replays["flash"] = torch_graph(torch, lambda c: sdpa(tq, c[0], c[1], enable_gqa=group > 1), tcaches)
    except Exception as error:   # the flash backend may refuse a shape (or enable_gqa)
        row["flash_error"] = f"{type(error).__name__}: {str(error)[:120]}"
    times = interleaved_ms(replays)
    for name, ms in times.items():
        row[f"{name}_gbs"] = kv_bytes / (2 if name == "ours_fp8" else 1) / ms / 1e6
        row[f"{name}_us"] = 1e3 * ms
    row["fp8_speedup"] = times["ours"] / times["ours_fp8"]
    if "flash_gbs" in row:
        row["ours_over_flash"] = row["ours_gbs"] / row["flash_gbs"]
    return row


def split_sweep(batch, length, heads_kv, splits, copies=4):
    """GB/s of flash_decode at each forced num_splits (None: the automatic choice) on one shape:
    the measurement behind choose_splits."""
    q, caches, lengths, kv_bytes, row = decode_case(batch, length, heads_kv, copies)
    replays = {n: cupy_graph(lambda c, n=n: cupy_flash.flash_decode(q, c[0], c[1], cache_seqlens=lengths, num_splits=n),
                             caches) for n in splits}
    for n, ms in interleaved_ms(replays).items():
        row[f"splits_{n}"] = kv_bytes / ms / 1e6
    return row


MLA_HEADS, MLA_D, MLA_D_V, MLA_PAGE = 128, 576, 512, 64


def mla_inputs(batch, length, seqlen_q, copies):
    """(q, ``copies`` bf16 latent caches in shuffled pages, flash_decode's cache options) of an MLA
    shape: every sequence ``length`` keys, causal with two tokens."""
    import numpy

    q = random_bf16((batch, seqlen_q, MLA_HEADS, MLA_D), 0)
    pages_per = -(-length // MLA_PAGE)
    order = numpy.random.default_rng(0).permutation(batch * pages_per).astype(numpy.int32)
    table = cupy.asarray(order.reshape(batch, pages_per))
    lengths = cupy.full((batch,), length, dtype=cupy.int32)
    caches = [random_bf16((batch * pages_per, MLA_PAGE, 1, MLA_D), i + 1) for i in range(copies)]
    return q, caches, dict(cache_seqlens=lengths, block_table=table, causal=seqlen_q > 1)


# The "separate v" column (the general kernel, 3-12x the MLA kernel's time) only up to this many
# cached keys in all (batch x length): past it a table's run is mostly that column.
MLA_SEPARATE_V_KEYS = 1 << 20


def mla_shape(batch, length, seqlen_q, copies):
    """A row of MLA decoding (--mla): GB/s and TFLOP/s from a bf16 and from an e4m3 latent cache."""
    from cupy_flash import families

    q, caches, options = mla_inputs(batch, length, seqlen_q, copies)
    rng = cupy.random.default_rng(7)
    fp8 = [rng.integers(0, 0x7e, k.shape, dtype=cupy.int32).astype(cupy.uint8) for k in caches]
    descale = cupy.full((batch, 1), 0.01, dtype=cupy.float32)
    replays = {
        "mla": cupy_graph(lambda k: cupy_flash.flash_decode(q, k, k[..., :MLA_D_V], **options), caches),
        "mla_fp8": cupy_graph(lambda k: cupy_flash.flash_decode(q, k, k[..., :MLA_D_V], k_descale=descale,
                                                                v_descale=descale, **options), fp8)}
    if batch * length <= MLA_SEPARATE_V_KEYS:
        # v a separate array: flash_decode_kernel (the MLA kernel reads v from k's tiles)
        separate = [(k, cupy.ascontiguousarray(k[..., :MLA_D_V])) for k in caches[:max(1, copies // 2)]]
        replays["separate_v"] = cupy_graph(lambda c: cupy_flash.flash_decode(q, c[0], c[1], **options), separate)

    def portable(k, **scales):   # the mma.sync MLA kernel (the setting is part of the plan's key)
        with families.use_kernels("portable"):
            return cupy_flash.flash_decode(q, k, k[..., :MLA_D_V], **scales, **options)

    replays["mla_portable"] = cupy_graph(portable, caches)
    replays["mla_fp8_portable"] = cupy_graph(lambda k: portable(k, k_descale=descale, v_descale=descale), fp8)
    times = interleaved_ms(replays)
    flops = 2 * batch * seqlen_q * MLA_HEADS * length * (MLA_D + MLA_D_V)
    row = dict(batch=batch, cache_len=length, seqlen_q=seqlen_q, heads=MLA_HEADS)
    for name, ms in times.items():   # (bytes: the latent cache's, once)
        cache_bytes = batch * length * MLA_D * (1 if name.startswith("mla_fp8") else 2)
        row[f"{name}_us"] = 1e3 * ms
        row[f"{name}_gbs"] = cache_bytes / ms / 1e6
        row[f"{name}_tflops"] = flops / ms / 1e9
    row["fp8_speedup"] = times["mla"] / times["mla_fp8"]
    row["over_separate_v"] = times["separate_v"] / times["mla"] if "separate_v" in times else None
    row["over_portable"] = times["mla_portable"] / times["mla"]
    row["fp8_over_portable"] = times["mla_fp8_portable"] / times["mla_fp8"]
    return row


def mla_table(batches, lengths, out):
    copy = copy_rate_gbs()
    result = dict(device=cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), copy_gbs=copy, rows=[])
    print(f"copy rate {copy:.0f} GB/s (read + write); MLA: {MLA_HEADS} heads, d {MLA_D} / v {MLA_D_V}, pages of {MLA_PAGE}",
          flush=True)
    print(f"{'batch':>5} {'cache':>7} {'s_q':>3} {'bf16 us':>8} {'GB/s':>6} {'of copy':>7} {'TFLOP/s':>7} "
          f"{'fp8 us':>7} {'GB/s':>6} {'TFLOP/s':>7} {'fp8 x':>5} {'sep. v us':>9} {'x sep.':>6} {'mma us':>8} {'x mma':>5} "
          f"{'fp8 mma us':>10} {'x':>5}")
    for batch in batches:
        for length in lengths:
            seqlen_q = 2 if batch >= 64 else 1
            copies = rotating_copies(batch * length * MLA_D * 2)
            if copies is None:
                continue
            row = mla_shape(batch, length, seqlen_q, copies)
            row["mla_of_copy"] = row["mla_gbs"] / copy
            result["rows"].append(row)
            separate = (f"{row['separate_v_us']:9.1f} {row['over_separate_v']:6.2f}" if row["over_separate_v"]
                        else f"{'-':>9} {'-':>6}")
            print(f"{batch:5d} {length:7d} {seqlen_q:3d} {row['mla_us']:8.1f} {row['mla_gbs']:6.0f} {row['mla_of_copy']:7.2f} "
                  f"{row['mla_tflops']:7.1f} {row['mla_fp8_us']:7.1f} {row['mla_fp8_gbs']:6.0f} {row['mla_fp8_tflops']:7.1f} "
                  f"{row['fp8_speedup']:5.2f} {separate} {row['mla_portable_us']:8.1f} {row['over_portable']:5.2f} "
                  f"{row['mla_fp8_portable_us']:10.1f} {row['fp8_over_portable']:5.2f}", flush=True)
            write_result(result, out, "decode-mla.json", quiet=True)   # the rows so far, should a time limit stop the run
            cupy.get_default_memory_pool().free_all_blocks()
    write_result(result, out, "decode-mla.json")


def main():
    global HEADS   # --heads: the table's query heads
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", nargs="+", type=int, default=[4096, 16384, 32768, 65536, 131072])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--sweep", nargs="+", default=None, metavar="N",
                        help="instead of the table: GB/s at each num_splits N ('auto': the automatic choice) "
                             "for every batch, length and GQA 8:1 / 1:1")
    parser.add_argument("--mla", action="store_true", help="MLA decoding (576 / 512, 128 heads) instead of the table")
    parser.add_argument("--heads", type=int, default=HEADS, help="query heads of the table (K/V heads: heads / 8 and heads)")
    args = parser.parse_args()
    HEADS = args.heads
    if args.mla:
        mla_table(args.batches, args.lengths, args.out)
        return
    if args.sweep:
        splits = [None if n == "auto" else int(n) for n in args.sweep]
        print(f"{'batch':>5} {'cache':>7} {'gqa':>4} " + " ".join(f"{n or 'auto':>7}" for n in splits) + "   (GB/s)")
        for heads_kv in (HEADS // 8, HEADS):
            for batch in args.batches:
                for length in args.lengths:
                    row = split_sweep(batch, length, heads_kv, splits)
                    print(f"{batch:5d} {length:7d} {row['gqa']:>4} " + " ".join(f"{row[f'splits_{n}']:7.0f}" for n in splits),
                          flush=True)
                    cupy.get_default_memory_pool().free_all_blocks()
        return
    copy = copy_rate_gbs()
    result = dict(device=cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), copy_gbs=copy, rows=[])
    print(f"copy rate {copy:.0f} GB/s (read + write)", flush=True)
    print(f"{'batch':>5} {'cache':>7} {'gqa':>4} {'ours us':>8} {'ours GB/s':>9} {'of copy':>7} {'paged':>7} {'fp8 GB/s':>8} "
          f"{'fp8 x':>5} {'flash':>7} {'ours/flash':>10}")
    for heads_kv in (HEADS // 8, HEADS):
        for batch in args.batches:
            for length in args.lengths:
                copies = rotating_copies(2 * batch * length * heads_kv * D * 2)
                if copies is None:
                    continue
                row = one_shape(batch, length, heads_kv, copies)
                row["ours_of_copy"] = row["ours_gbs"] / copy
                result["rows"].append(row)
                flash = row.get("flash_gbs")
                print(f"{batch:5d} {length:7d} {row['gqa']:>4} {row['ours_us']:8.2f} {row['ours_gbs']:9.0f} "
                      f"{row['ours_of_copy']:7.2f} "
                      f"{row['ours_paged_gbs']:7.0f} {row['ours_fp8_gbs']:8.0f} {row['fp8_speedup']:5.2f} "
                      + (f"{flash:7.0f} {row['ours_over_flash']:10.2f}" if flash else
                                                          f"{'n/a':>7} {'':>10} {row['flash_error'][:60]}"), flush=True)
                cupy.get_default_memory_pool().free_all_blocks()
    write_result(result, args.out, "decode-bf16.json")


if __name__ == "__main__":
    main()
