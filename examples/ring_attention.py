"""Ring attention (context parallelism) in pure CuPy: forward + backward over a sequence split across
GPUs, checked against one GPU's flash call over the whole sequence.

    python -m cupy_flash launch -n 2 examples/ring_attention.py --tokens 65536      # one process per GPU
    torchrun --nproc_per_node 2 examples/ring_attention.py --tokens 65536           # the same, by torchrun
    NCCL_NVLS_ENABLE=0 mpirun -n 2 python examples/ring_attention.py --tokens 65536   # or by mpirun
    python examples/ring_attention.py --virtual-ranks 4                             # one GPU, 4 virtual ranks
    python -m cupy_flash launch -n 2 examples/ring_attention.py --lengths 4096 12288 32  # a packed batch

Each rank keeps its zigzag shard of q, k, v (chunks r and 2P - 1 - r of 2P), so causal work is equal
across ranks; K/V travel around the ring over NCCL while each rank attends to the shard in hand. The
ring comes from the launcher's environment (``NcclRing.from_environment``: rank, world size, GPU and
rank 0's NCCL id, without MPI or PyTorch). With --lengths the sequence is a packed batch of
sequences of those lengths (each a multiple of 2 x ranks), each cut into 2P chunks, every rank
holding chunks r and 2P - 1 - r of each (``zigzag_shard_packed``). Each rank prints its outputs' max
error against its part of the single-GPU result; exits 1 if one is out of bounds (the launcher
passes that on).
"""

import argparse
import sys

import cupy
import ml_dtypes
import numpy

import cupy_flash
from cupy_flash import distributed
from cupy_flash._device import require_gpu


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32768, help="total sequence length (a multiple of 2 x ranks)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--virtual-ranks", type=int, default=4, help="ranks simulated on one GPU without mpirun")
    parser.add_argument("--lengths", type=int, nargs="+", help="a packed batch of these sequence lengths instead")
    args = parser.parse_args()
    require_gpu("ring_attention")   # one line and exit status 1 where there is none

    place = distributed.launch_environment()   # started by a launcher with several processes?
    cu_seqlens = None if args.lengths is None else numpy.concatenate([[0], numpy.cumsum(args.lengths)]).astype("int32")
    shape = (1, args.tokens, args.heads, args.head_dim) if cu_seqlens is None else \
        (int(cu_seqlens[-1]), args.heads, args.head_dim)
    packed = {} if cu_seqlens is None else dict(cu_seqlens=cu_seqlens)
    if place.world > 1:   # one GPU each, NCCL between them
        ring = distributed.NcclRing.from_environment()
        world = ring.world
    rng = cupy.random.default_rng(0)   # the same full sequence on every rank (on its GPU)
    q, k, v, do = (rng.standard_normal(shape, dtype=cupy.float32).astype(ml_dtypes.bfloat16) for _ in range(4))

    world = ring.world if place.world > 1 else args.virtual_ranks

    def shard(x, rank):   # rank's zigzag shard: of the sequence, or of every sequence of the packed batch
        if cu_seqlens is None:
            return distributed.zigzag_shard(x, rank, world)
        return distributed.zigzag_shard_packed(x, cu_seqlens, rank, world)

    def unshard(shards):
        return distributed.zigzag_unshard(shards) if cu_seqlens is None else \
            distributed.zigzag_unshard_packed(shards, cu_seqlens)

    if place.world > 1:
        mine = [shard(x, ring.rank) for x in (q, k, v, do)]
        o, lse = distributed.ring_attention_forward(*mine[:3], ring=ring, causal=True, **packed)
        grads = distributed.ring_attention_backward(mine[3], *mine[:3], o, lse, ring=ring, causal=True, **packed)
        ours = [o, *grads]
        label = f"rank {ring.rank} of {world}"
    else:
        shards = [[shard(x, r) for r in range(world)] for x in (q, k, v, do)]
        outs = distributed.simulate_ring_forward(*shards[:3], causal=True, **packed)
        grads = distributed.simulate_ring_backward(shards[3], *shards[:3], [o for o, _ in outs], [lse for _, lse in outs],
                                                   causal=True, **packed)
        ours = [unshard([o for o, _ in outs])] + [unshard([g[i] for g in grads]) for i in range(3)]
        label = f"{world} virtual ranks"

    whole = {} if cu_seqlens is None else dict(cu_seqlens_q=cupy.asarray(cu_seqlens), cu_seqlens_k=cupy.asarray(cu_seqlens))
    one_o, one_lse = cupy_flash.flash_forward(q, k, v, causal=True, **whole)   # one GPU, the whole sequence (batch)
    ones = [one_o, *cupy_flash.flash_backward(do, q, k, v, one_o, one_lse, causal=True, **whole)]
    if place.world > 1:   # this rank's part of them
        ones = [shard(x, ring.rank) for x in ones]
    failed = False
    for name, x, one in zip(("o", "dq", "dk", "dv"), ours, ones):
        error = float(abs(x.astype(cupy.float32) - one.astype(cupy.float32)).max())
        size = float(abs(one.astype(cupy.float32)).max())
        tokens = args.tokens if cu_seqlens is None else f"lengths {args.lengths}"
        print(f"{name}: max |ring - one GPU| = {error:.3e} (values up to {size:.3e}; {label}, {tokens} tokens)")
        failed |= not error <= 2e-2 * size   # two bf16 roundings apart, at most
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
