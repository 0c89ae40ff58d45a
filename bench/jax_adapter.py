"""The JAX adapter's time per call under jax.jit against calling cupy_flash directly on CuPy arrays
(the same kernels: the difference is the adapter's cost), and against jax.nn.dot_product_attention
(cuDNN and XLA), forward and forward+backward, bf16, d = 128, in one run.

    python -m bench.jax_adapter [--seqlens 4096 16384]

Times are wall-clock per call over a loop of 20 calls ended by one synchronisation (what a jitted
training step sees: launch costs included), the median of 7 loops after warm-up, the direct and
the jitted loops interleaved; the inputs rotate over 3 sets. TFLOP/s by FlashAttention's count.
"""

from __future__ import annotations

# ruff: noqa: E402 - the imports follow the help guard, which must run first
from bench import help_first, peer_or_exit

help_first("jax_adapter", __doc__)
peer_or_exit("jax_adapter", "jax")

import argparse
import os
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.45")   # the rest for CuPy's pool

import cupy  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402

import cupy_flash  # noqa: E402
from cupy_flash.jax_adapter import flash_attention  # noqa: E402

from .attention import flops  # noqa: E402


def per_call(*timed, calls=20, loops=7):
    """Median seconds per call of each (run, sets, sync) in ``timed``, their loops interleaved
    (A B A B ...) so a drift of the GPU's clocks during the measurement falls on all alike."""
    for run, sets, sync in timed:
        for s in sets:
            run(s)
        sync()
    times = [[] for _ in timed]
    for _ in range(loops):
        for (run, sets, sync), samples in zip(timed, times):
            start = time.perf_counter()
            for i in range(calls):
                run(sets[i % len(sets)])
            sync()
            samples.append((time.perf_counter() - start) / calls)
    return [statistics.median(samples) for samples in times]

def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.jax_adapter", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", nargs="+", type=int, default=[4096, 16384])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=16)
    args = parser.parse_args(argv)
    d = 128
    print("| N | causal | mode | cupy_flash direct | ours under jax.jit | jit / direct | jax cudnn | jax xla | ours / cudnn |")
    print("|---|---|---|---|---|---|---|---|---|")
    for seqlen in args.seqlens:
        batch = max(1, args.tokens // seqlen)
        shape = (batch, seqlen, args.heads, d)
        for causal in (False, True):
            keys = jax.random.split(jax.random.PRNGKey(seqlen + causal), 12)
            jsets = [tuple(jax.random.normal(keys[4 * i + j], shape, jnp.bfloat16) for j in range(4)) for i in range(3)]
            csets = [tuple(cupy.from_dlpack(x.view(jnp.uint16)).view(ml_dtypes.bfloat16) for x in s) for s in jsets]
            for mode in ("fwd", "fwd_bwd"):
                work = flops(batch, args.heads, seqlen, d, causal, "fwd" if mode == "fwd" else "fwd_bwd")
                if mode == "fwd":
                    ours_jit = jax.jit(lambda q, k, v, do: flash_attention(q, k, v, causal=causal))

                    def direct(s):
                        return cupy_flash.flash_forward(s[0], s[1], s[2], causal=causal)
                else:
                    def loss(q, k, v, do):
                        return (flash_attention(q, k, v, causal=causal).astype(jnp.float32) * do.astype(jnp.float32)).sum()
                    ours_jit = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

                    def direct(s):
                        o, lse = cupy_flash.flash_forward(s[0], s[1], s[2], causal=causal)
                        return cupy_flash.flash_backward(s[3], s[0], s[1], s[2], o, lse, causal=causal)
                last = []

                def run_jit(s, fn=ours_jit):
                    last[:] = [fn(*s)]

                def sync_jax():
                    jax.block_until_ready(last)
                t_direct, t_jit = per_call((direct, csets, cupy.cuda.get_current_stream().synchronize),
                                           (run_jit, jsets, sync_jax))
                peers = {}
                for implementation in ("cudnn", "xla"):
                    if implementation == "xla" and seqlen > 4096:
                        peers[implementation] = None   # XLA materialises the scores: 16k^2 x heads does not fit
                        continue

                    def attention(q, k, v, implementation=implementation):
                        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=implementation)
                    if mode == "fwd":
                        fn = jax.jit(lambda q, k, v, do, attention=attention: attention(q, k, v))
                    else:
                        fn = jax.jit(jax.grad(lambda q, k, v, do, attention=attention: (
                            attention(q, k, v).astype(jnp.float32) * do.astype(jnp.float32)).sum(), argnums=(0, 1, 2)))
                    try:
                        peers[implementation] = per_call((lambda s, fn=fn: run_jit(s, fn), jsets, sync_jax))[0]
                    except Exception as error:   # noqa: BLE001 - a backend may refuse a shape
                        print(f"# {implementation} {seqlen} causal={causal} {mode}: {type(error).__name__}: {str(error)[:100]}")
                        peers[implementation] = None
                rate = {name: (None if t is None else work / t / 1e12) for name, t in
                        dict(direct=t_direct, jit=t_jit, **peers).items()}
                cell = lambda x: "-" if x is None else f"{x:.0f}"   # noqa: E731
                ratio = "-" if rate["cudnn"] is None else f"{rate['jit'] / rate['cudnn']:.2f}"
                print(f"| {seqlen} | {int(causal)} | {mode} | {cell(rate['direct'])} | {cell(rate['jit'])} | "
                      f"{t_jit / t_direct:.3f} | {cell(rate['cudnn'])} | {cell(rate['xla'])} | {ratio} |", flush=True)

if __name__ == "__main__":
    main()
