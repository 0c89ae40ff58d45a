"""A jitted JAX training step whose attention is cupy_flash's (forward and backward kernels inside
the compiled step), beside the same step with JAX's own attention: the loss curves agree.

    python examples/jax_train_step.py

One causal self-attention block (bf16 activations, float32 parameters) learns to imitate a fixed
random "teacher" block; Adam, 30 steps, the whole step under jax.jit.
Needs an NVIDIA GPU, CuPy and JAX with CUDA.
"""

import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")   # leave GPU memory to CuPy's pool too

from cupy_flash._device import install_hint, require_gpu  # noqa: E402

try:
    import jax
    import jax.numpy as jnp
except ImportError as error:
    sys.exit(f"jax_train_step needs JAX with CUDA: {install_hint('cuda12,jax')} ({error})")
require_gpu("jax_train_step")

from cupy_flash.jax_adapter import flash_attention  # noqa: E402

BATCH, SEQLEN, HEADS, HEAD_DIM = 4, 1024, 4, 64
WIDTH = HEADS * HEAD_DIM


def block(params, x, attention):
    """x + W_o attention(x W_q, x W_k, x W_v), causal; x (batch, seqlen, width) bf16."""
    qkv = (x @ params["qkv"].astype(x.dtype)).reshape(BATCH, SEQLEN, 3, HEADS, HEAD_DIM)
    o = attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]).reshape(BATCH, SEQLEN, WIDTH)
    return x + o @ params["out"].astype(x.dtype)


def ours(q, k, v):
    return flash_attention(q, k, v, causal=True)


def jax_own(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")


def init(key, scale):
    a, b = jax.random.split(key)
    return {"qkv": jax.random.normal(a, (WIDTH, 3 * WIDTH)) * scale, "out": jax.random.normal(b, (WIDTH, WIDTH)) * scale}


def main():
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    teacher, start = init(keys[0], WIDTH ** -0.5), init(keys[1], 0.5 * WIDTH ** -0.5)
    x = jax.random.normal(keys[2], (BATCH, SEQLEN, WIDTH), jnp.bfloat16)
    target = block(teacher, x, jax_own).astype(jnp.float32)

    def make_step(attention):
        def loss(params):
            return jnp.mean((block(params, x, attention).astype(jnp.float32) - target) ** 2)

        @jax.jit
        def step(params, moments, t):   # Adam, written out (no optimiser library needed)
            value, grads = jax.value_and_grad(loss)(params)
            first = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, moments[0], grads)
            second = jax.tree.map(lambda m, g: 0.999 * m + 0.001 * g * g, moments[1], grads)
            params = jax.tree.map(lambda p, m, s: p - 3e-3 * (m / (1 - 0.9 ** t)) / (jnp.sqrt(s / (1 - 0.999 ** t)) + 1e-8),
                                  params, first, second)
            return params, (first, second), value
        return step

    curves = {}
    for name, attention in (("cupy_flash", ours), ("jax xla", jax_own)):
        step, params, curve = make_step(attention), start, []
        moments = (jax.tree.map(jnp.zeros_like, start), jax.tree.map(jnp.zeros_like, start))
        for t in range(1, 31):
            params, moments, value = step(params, moments, t)
            curve.append(float(value))
        curves[name] = curve
    print("step  cupy_flash   jax (xla attention)")
    for i in range(0, 30, 5):
        print(f"{i:4d}  {curves['cupy_flash'][i]:.6f}   {curves['jax xla'][i]:.6f}")
    first, last = curves["cupy_flash"][0], curves["cupy_flash"][-1]
    gap = max(abs(a - b) / b for a, b in zip(curves["cupy_flash"], curves["jax xla"]))
    print(f"loss {first:.5f} -> {last:.5f}; largest relative gap to JAX's attention {gap:.2%}")
    if not (last < 0.7 * first and gap < 0.05):
        sys.exit("the jitted step did not train like the reference")


if __name__ == "__main__":
    main()
