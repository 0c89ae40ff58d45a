"""The JAX ring (jax_adapter.ring_attention) and all-to-all (ulysses_attention) over every GPU of one
host, against one GPU.

    XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 python -m bench.jax_ring [--seqlens 131072]

Per total length (causal, d = 128, bf16, 16 heads, batch 1; zigzag shards for the ring, contiguous
for all-to-all): forward + backward (jax.grad of a weighted sum) under jax.jit over a mesh of all
GPUs, and the same on one GPU over the whole sequence (jax_adapter.flash_attention); wall-clock per
step, median of 5 after warm-up (the step ends in block_until_ready). The speed-up over one GPU and
its efficiency (speed-up / GPUs) compare with bench/ring_nccl.py's (CUDA events per rank).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")   # leave the rest to CuPy's pool

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from cupy_flash.distributed import zigzag_indices  # noqa: E402
from cupy_flash.jax_adapter import flash_attention, ring_attention, shard_map, ulysses_attention  # noqa: E402

HEADS, D = 16, 128


def seconds(step, args, rounds: int = 5) -> float:
    jax.block_until_ready(step(*args))   # compile and warm
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        jax.block_until_ready(step(*args))
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", nargs="+", type=int, default=[131072])
    args = parser.parse_args()
    devices = [d for d in jax.devices() if d.platform == "gpu"]
    world = len(devices)
    mesh = Mesh(numpy.array(devices), ("ring",))
    spec = P(None, "ring")
    ring = shard_map(lambda q, k, v: ring_attention(q, k, v, "ring", causal=True), mesh, (spec,) * 3, spec)
    ulysses = shard_map(lambda q, k, v: ulysses_attention(q, k, v, "ring", causal=True), mesh, (spec,) * 3, spec)

    def step_of(attention):
        def loss(q, k, v, w):
            return (attention(q, k, v).astype(jnp.float32) * w).sum()
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    print(f"{'tokens':>8} {'GPUs':>4} {'ring ms':>8} {'all-to-all ms':>13} {'one GPU ms':>10} {'speed-up':>8} "
          f"{'efficiency':>10} {'a2a speed-up':>12}", flush=True)
    for seqlen in args.seqlens:
        key = jax.random.PRNGKey(seqlen)
        q, k, v = (jax.random.normal(x, (1, seqlen, HEADS, D), jnp.bfloat16) for x in jax.random.split(key, 3))
        w = jnp.ones((1, seqlen, HEADS, D), jnp.float32)
        index = jnp.asarray(zigzag_indices(seqlen, world))
        sharding = NamedSharding(mesh, spec)
        sharded = [jax.device_put(x[:, index], sharding) for x in (q, k, v, w)]
        ring_s = seconds(step_of(ring), sharded)
        contiguous = [jax.device_put(x, sharding) for x in (q, k, v, w)]
        ulysses_s = seconds(step_of(ulysses), contiguous)
        one = [jax.device_put(x, devices[0]) for x in (q, k, v, w)]
        one_s = seconds(step_of(lambda q, k, v: flash_attention(q, k, v, causal=True)), one)
        print(f"{seqlen:8d} {world:4d} {ring_s * 1e3:8.1f} {ulysses_s * 1e3:13.1f} {one_s * 1e3:10.1f} "
              f"{one_s / ring_s:8.2f} {one_s / ring_s / world:10.2f} {one_s / ulysses_s:12.2f}", flush=True)


if __name__ == "__main__":
    main()
