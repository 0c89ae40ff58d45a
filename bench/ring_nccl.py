"""The NCCL ring on several GPUs of one host: exactness, overlap and scaling in one run.

    NCCL_NVLS_ENABLE=0 mpirun -n 2 python bench/ring_nccl.py [--seqlens 131072 524288] [--window 4096 | --packed]
        [--mode ring | ulysses] [--out DIR]

One process per GPU (rank r on GPU r). Every rank draws the same full sequence (one seed), keeps
its zigzag shard and runs ``ring_attention_forward`` / ``ring_attention_backward``:
  - exactness (total 2048 tokens, causal and not, bf16 and fp16): the gathered outputs and gradients
    against the float64 reference, beside a dense low-precision reference and one flash call over
    the whole sequence (err / low-precision err: the 2x / 3x rule);
  - per total length (causal, d = 128, bf16, 16 heads, batch 1; with --window W a sliding window
    of W keys back, window_size (W, 0), the ring and the one GPU alike): forward + backward time of the
    ring, of the same kernel calls with the transport removed (each rank keeps its own K/V:
    compute only), and of one GPU over the whole sequence (rank 0); the overlap ratio (ring /
    compute only), the speed-up over one GPU and its efficiency (speed-up / GPUs), each rank's compute
    time (imbalance) and its peak pool memory (O(local tokens)). With --packed the total length is a
    packed batch of four sequences of mixed lengths (1/2, 1/4, 1/8, 1/8 of it; cu_seqlens), the ring
    against one GPU running the same packed call. With --mode ulysses the same runs take the
    all-to-all over heads (``ulysses_attention_forward`` / ``_backward``, contiguous shards; K/V
    heads 4 in the exactness runs).
Rank 0 prints the table last and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import cupy
import ml_dtypes
import numpy

import cupy_flash
from cupy_flash import distributed

DTYPES = {"bf16": ml_dtypes.bfloat16, "fp16": numpy.float16}


class _SelfRing(distributed.NcclRing):
    """The same schedule with the transport removed: a shift hands each rank its own payload."""

    def __init__(self, rank, world):   # noqa: D107 - no communicator, no stream
        self.rank, self.world, self.ranks = rank, world, (rank,)

    def start_shift(self, payloads, reverse=False):
        return payloads

    def finish_shift(self, handle):
        return handle

    def all_to_all(self, payloads):   # each chunk "arrives" from its destination: the shapes of the real one
        return payloads


def full(shape, dtype, seed):
    return cupy.random.default_rng(seed).standard_normal(shape, dtype=cupy.float32).astype(dtype)


def gather(mpi, x):
    """Every rank's array on rank 0 (host), in rank order; None elsewhere."""
    parts = mpi.gather(cupy.asnumpy(x), root=0)
    return parts


def contiguous_shard(x, rank, world):
    rows = x.shape[1] // world
    return x[:, rank * rows:(rank + 1) * rows]


def mode_calls(mode, group_size=None):
    """(shard, unshard, forward, backward, self_ring) of a mode: the ring's zigzag shards and calls,
    the all-to-all's contiguous ones, or the hybrid's (``ring``: the (within, across) pair);
    self_ring(rank, world): its transport removed."""
    if mode == "ulysses":
        return (contiguous_shard, lambda parts: cupy.concatenate(parts, axis=1), distributed.ulysses_attention_forward,
                distributed.ulysses_attention_backward, _SelfRing)
    if mode == "hybrid":
        def forward(*arrays, ring, **options):
            return distributed.hybrid_attention_forward(*arrays, within=ring[0], across=ring[1], **options)

        def backward(*arrays, ring, **options):
            return distributed.hybrid_attention_backward(*arrays, within=ring[0], across=ring[1], **options)

        def self_ring(rank, world):
            g, u = divmod(rank, group_size)
            return _SelfRing(u, group_size), _SelfRing(g, world // group_size)
        return (lambda x, rank, world: distributed.hybrid_shard(x, rank, world, group_size),
                lambda parts: distributed.hybrid_unshard(parts, group_size), forward, backward, self_ring)
    return (distributed.zigzag_shard, distributed.zigzag_unshard, distributed.ring_attention_forward,
            distributed.ring_attention_backward, _SelfRing)


def exactness(mpi, ring, rank, world, dtype_name, causal, window=None, mode="ring", group_size=None):
    dtype = DTYPES[dtype_name]
    shard, unshard, forward, backward, _ = mode_calls(mode, group_size)
    batch, seqlen, heads, heads_kv, d = 1, 2048, 8, (2 if mode == "ring" else 4), 128   # K/V heads: multiples of U
    q, do = full((batch, seqlen, heads, d), dtype, 1), full((batch, seqlen, heads, d), dtype, 4)
    k, v = full((batch, seqlen, heads_kv, d), dtype, 2), full((batch, seqlen, heads_kv, d), dtype, 3)
    mine = [shard(x, rank, world) for x in (q, k, v, do)]
    o, lse = forward(*mine[:3], ring=ring, causal=causal, window_size=window)
    grads = backward(mine[3], *mine[:3], o, lse, ring=ring, causal=causal, window_size=window)
    gathered = [gather(mpi, x) for x in (o, *grads)]
    if rank != 0:
        return None
    ours = [unshard([cupy.asarray(p) for p in parts]) for parts in gathered]
    exact_o, _ = cupy_flash.attention_reference(q, k, v, causal=causal, window_size=window)
    low_o, _ = cupy_flash.attention_reference(q, k, v, causal=causal, window_size=window, upcast=False)
    one_o, one_lse = cupy_flash.flash_forward(q, k, v, causal=causal, window_size=window)
    exact_g = cupy_flash.attention_reference_backward(do, q, k, v, causal=causal, window_size=window)
    low_g = cupy_flash.attention_reference_backward(do, q, k, v, causal=causal, window_size=window, upcast=False)
    one_g = cupy_flash.flash_backward(do, q, k, v, one_o, one_lse, causal=causal, window_size=window)

    def err(x, ref):
        return float(abs(x.astype(cupy.float64) - ref).max())

    row = {"dtype": dtype_name, "causal": causal, "window": window}
    for name, x, e, lo, one, bound in (("o", ours[0], exact_o, low_o, one_o, 2),
                                       *[(n, ours[i + 1], exact_g[i], low_g[i], one_g[i], 3)
                                         for i, n in enumerate(("dq", "dk", "dv"))]):
        reference_err = max(err(lo, e), err(one, e), 1e-5)
        row[name] = err(x, e) / reference_err
        row[name + "_ok"] = row[name] <= bound
    return row


def timed(fn, repeats=5):
    fn()
    cupy.cuda.Device().synchronize()
    times = []
    for _ in range(repeats):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return statistics.median(times)


def mixed_lengths(total: int) -> numpy.ndarray:
    """--packed's prefix sums: four sequences of 1/2, 1/4, 1/8 and 1/8 of ``total`` tokens."""
    return numpy.concatenate([[0], numpy.cumsum([total // 2, total // 4, total // 8, total // 8])]).astype(numpy.int32)


def scaling(mpi, ring, rank, world, total, window, packed=False, mode="ring", group_size=None):
    batch, heads, d, dtype = 1, 16, 128, ml_dtypes.bfloat16
    local = total // world
    cu = mixed_lengths(total) if packed else None
    shape, options = ((total, heads, d), dict(cu_seqlens=cu)) if packed else ((batch, total, heads, d), {})
    shard, _, forward, backward, self_ring = mode_calls(mode, group_size)
    if packed:
        mine = [distributed.zigzag_shard_packed(full(shape, dtype, s), cu, rank, world) for s in range(4)]
    else:
        mine = [shard(full(shape, dtype, s), rank, world) for s in range(4)]
    cupy.get_default_memory_pool().free_all_blocks()

    def train_step(r):
        o, lse = forward(*mine[:3], ring=r, causal=True, window_size=window, **options)
        backward(mine[3], *mine[:3], o, lse, ring=r, causal=True, window_size=window, **options)

    mpi.Barrier()
    ring_ms = timed(lambda: train_step(ring))
    peak = cupy.get_default_memory_pool().total_bytes()
    compute_ms = timed(lambda: train_step(self_ring(rank, world)))
    one_ms = None
    if rank == 0:
        try:
            whole = [full(shape, dtype, s) for s in range(4)]
            one_options = dict(cu_seqlens_q=cupy.asarray(cu), cu_seqlens_k=cupy.asarray(cu)) if packed else {}

            def one():
                o, lse = cupy_flash.flash_forward(*whole[:3], causal=True, window_size=window, **one_options)
                cupy_flash.flash_backward(whole[3], *whole[:3], o, lse, causal=True, window_size=window, **one_options)
            one_ms = timed(one)
            del whole
        except cupy.cuda.memory.OutOfMemoryError:
            one_ms = None
    computes = mpi.gather(compute_ms, root=0)
    rings = mpi.gather(ring_ms, root=0)
    peaks = mpi.gather(peak, root=0)
    if rank != 0:
        return None
    ring_time = max(rings)
    return {"total": total, "local": local, "window": window, "packed": cu.tolist() if packed else None, "mode": mode,
            "ring_ms": ring_time, "compute_ms": max(computes),
            "overlap": ring_time / max(computes), "one_gpu_ms": one_ms,
            "speedup": one_ms / ring_time if one_ms else None,
            "imbalance": max(computes) / min(computes) - 1, "peak_bytes_per_rank": peaks,
            "qkv_do_bytes_per_rank": 4 * batch * local * heads * d * 2}


def main():
    parser = argparse.ArgumentParser(prog="python -m bench.ring_nccl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", nargs="+", type=int, default=[131072, 524288])
    parser.add_argument("--window", type=int, default=None, help="a sliding window of this many keys back")
    parser.add_argument("--packed", action="store_true", help="each length a packed batch of four mixed lengths")
    parser.add_argument("--mode", default="ring", choices=["ring", "ulysses", "hybrid"],
                        help="the ring, all-to-all over heads, or all-to-all inside groups and the ring across them")
    parser.add_argument("--group-size", type=int, default=2, help="--mode hybrid: ranks per all-to-all group")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    if args.packed and args.window is not None:
        parser.error("--packed and --window: the ring takes no window on packed shards")
    if args.packed and args.mode != "ring":
        parser.error("--packed takes the ring")
    from mpi4py import MPI

    mpi = MPI.COMM_WORLD
    rank, world = mpi.Get_rank(), mpi.Get_size()
    cupy.cuda.Device(rank % cupy.cuda.runtime.getDeviceCount()).use()
    if args.mode == "hybrid":   # (within, across): ids shared by mpi4py under mpirun
        ring = distributed.NcclRing.from_environment(group_size=args.group_size)
    else:
        ring = distributed.NcclRing.create(rank, world, broadcast=lambda x: mpi.bcast(x, root=0))
    started = time.time()
    modes = dict(mode=args.mode, group_size=args.group_size)
    exact = [exactness(mpi, ring, rank, world, dtype, causal, **modes) for dtype in DTYPES for causal in (False, True)]
    exact.append(exactness(mpi, ring, rank, world, "bf16", True, (300, 0), **modes))
    window = None if args.window is None else (args.window, 0)
    scale = [scaling(mpi, ring, rank, world, total, window, args.packed, **modes) for total in args.seqlens]
    if rank != 0:
        return
    result = {"world": world, "device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
              "exactness": exact, "scaling": scale, "seconds": time.time() - started}
    suffix = ("_packed" if args.packed else "") + (f"_{args.mode}" if args.mode != "ring" else "")
    path = os.path.join(args.out, f"ring_nccl_{world}gpu{suffix}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("exactness (err / reference err; the rule: o <= 2, gradients <= 3)")
    for row in exact:
        print(f"  {row['dtype']} causal={int(row['causal'])} window={row['window']}: o {row['o']:.2f} dq {row['dq']:.2f} "
              f"dk {row['dk']:.2f} dv {row['dv']:.2f} {'ok' if all(row[n + '_ok'] for n in ('o', 'dq', 'dk', 'dv')) else 'FAIL'}")
    print("| tokens | GPUs | ring ms | compute-only ms | overlap | one GPU ms | speed-up | efficiency | imbalance | "
          "peak GB/rank |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in scale:
        one = f"{row['one_gpu_ms']:.1f}" if row["one_gpu_ms"] else "n/a"
        speed = f"{row['speedup']:.2f}" if row["speedup"] else "n/a"
        efficiency = f"{row['speedup'] / world:.3f}" if row["speedup"] else "n/a"
        tokens = f"{row['total']} (packed)" if row.get("packed") else row["total"]
        print(f"| {tokens} | {world} | {row['ring_ms']:.1f} | {row['compute_ms']:.1f} | {row['overlap']:.3f} | "
              f"{one} | {speed} | {efficiency} | {100 * row['imbalance']:.1f}% | "
              f"{max(row['peak_bytes_per_rank']) / 1e9:.2f} |")
    print(f"JSON: {path}")


if __name__ == "__main__":
    main()
