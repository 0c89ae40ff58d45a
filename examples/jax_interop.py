"""JAX arrays in, JAX arrays out, through DLPack (no copies), with manual gradients.

    python examples/jax_interop.py

JAX owns the arrays; cupy_flash reads them through __dlpack__ and returns CuPy arrays, which
jax.dlpack.from_dlpack takes back. The gradient is checked against jax.grad of a dense attention
written in jax.numpy. Needs an NVIDIA GPU, CuPy and JAX with CUDA (pip install ".[cuda12,jax]").
"""

import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # leave GPU memory to CuPy too

from cupy_flash._device import install_hint, require_gpu

try:
    import jax
    import jax.numpy as jnp
except ImportError as error:
    sys.exit(f"jax_interop needs JAX with CUDA: {install_hint('cuda12,jax')} ({error})")
require_gpu("jax_interop")
if not any(device.platform == "gpu" for device in jax.devices()):
    sys.exit("jax_interop needs JAX with CUDA (jax[cuda12] or jax[cuda13]): this JAX sees no GPU")

import cupy  # noqa: E402

import cupy_flash  # noqa: E402


def dense_attention(q, k, v):
    """(batch, seqlen, heads, d) causal attention in jax.numpy, for the check."""
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1])
    n_q, n_k = q.shape[1], k.shape[1]
    mask = jnp.arange(n_k)[None, :] <= jnp.arange(n_q)[:, None] + (n_k - n_q)
    scores = jnp.where(mask, scores, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


def main():
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v, do = (jax.random.normal(key, (2, 512, 4, 64), dtype=jnp.float16) for key in keys)

    # JAX -> CuPy: cupy_flash takes JAX arrays directly (DLPack, no copy).
    o, lse = cupy_flash.flash_forward(q, k, v, causal=True)
    dq, dk, dv = cupy_flash.flash_backward(do, q, k, v, o, lse, causal=True)
    cupy.cuda.get_current_stream().synchronize()

    # CuPy -> JAX: no copy either.
    o_jax = jax.dlpack.from_dlpack(o)
    dq_jax = jax.dlpack.from_dlpack(dq)

    # The check: JAX's own autodiff of dense attention in float32.
    q32, k32, v32, do32 = (x.astype(jnp.float32) for x in (q, k, v, do))
    o_ref, vjp = jax.vjp(dense_attention, q32, k32, v32)
    dq_ref, _, _ = vjp(do32)
    print(f"o:  max |cupy_flash - jax dense| = {float(jnp.abs(o_jax.astype(jnp.float32) - o_ref).max()):.2e}")
    print(f"dq: max |cupy_flash - jax dense| = {float(jnp.abs(dq_jax.astype(jnp.float32) - dq_ref).max()):.2e}")
    print(f"types: {type(o).__module__}.{type(o).__name__} -> {type(o_jax).__module__}.{type(o_jax).__name__}")


if __name__ == "__main__":
    main()
