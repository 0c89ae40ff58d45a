"""The JAX ring (jax_adapter.ring_attention) on a mesh of virtual CPU devices, its kernels' calls
replaced by dense float32 attention written in JAX: the ring's schedule, merges, sink join,
shifts and custom gradient, checked against the float64 reference of the unsplit sequence. Run by
tests/test_jax_ring_cpu.py in a process of its own (XLA_FLAGS must set the device count before JAX
starts); prints one JSON line of worst errors per case.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu python tests/jax_ring_cpu.py
"""

from __future__ import annotations

import json
import math
import sys

import jax
import jax.numpy as jnp
import numpy
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from cupy_flash import attention_reference, attention_reference_backward, jax_adapter
from cupy_flash.distributed import zigzag_indices
from cupy_flash.reference import _visible

jax.config.update("jax_enable_x64", False)


def dense_calls(static: tuple) -> tuple:
    """Stand-ins of jax_adapter._calls: (forward, backward) of one block in float32, the kernels'
    contract: o (batch, rows, heads, d_v) in q's dtype and lse (batch, heads, rows) float32, -inf
    where a row sees no key; the backward takes o and lse as given (the ring's merged ones)."""
    options = dict(static)
    causal, window, softcap = options["causal"], options["window_size"], options["softcap"]

    def scores(q, k):
        scale = 1.0 / math.sqrt(q.shape[-1]) if options["softmax_scale"] is None else options["softmax_scale"]
        group = q.shape[2] // k.shape[2]
        kf = jnp.repeat(k.astype(jnp.float32), group, axis=2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), kf) * scale
        tanh = None
        if softcap:
            tanh = jnp.tanh(s / softcap)
            s = softcap * tanh
        visible = _visible(q.shape[1], k.shape[1], causal, jnp, window)   # the reference's mask, or None
        if visible is None:
            visible = jnp.ones(s.shape[-2:], bool)
        return jnp.where(visible, s, -jnp.inf), visible, tanh, scale, group

    def forward(q, k, v):
        s, _, _, _, group = scores(q, k)
        lse = jax.nn.logsumexp(s, axis=-1)
        p = jnp.where(jnp.isfinite(lse)[..., None], jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
        vf = jnp.repeat(v.astype(jnp.float32), group, axis=2)
        return jnp.einsum("bhqk,bkhd->bqhd", p, vf).astype(q.dtype), lse

    def backward(do, q, k, v, o, lse):
        s, visible, tanh, scale, group = scores(q, k)
        p = jnp.where(visible & jnp.isfinite(lse)[..., None], jnp.exp(s - lse[..., None]), 0.0)
        dof, vf = do.astype(jnp.float32), jnp.repeat(v.astype(jnp.float32), group, axis=2)
        kf = jnp.repeat(k.astype(jnp.float32), group, axis=2)
        dv = jnp.einsum("bhqk,bqhd->bkhd", p, dof)
        dp = jnp.einsum("bqhd,bkhd->bhqk", dof, vf)
        delta = (dof * o.astype(jnp.float32)).sum(-1).transpose(0, 2, 1)[..., None]
        ds = p * (dp - delta)
        if tanh is not None:
            ds = ds * (1 - tanh * tanh)
        dq = jnp.einsum("bhqk,bkhd->bqhd", ds, kf) * scale
        dk = jnp.einsum("bhqk,bqhd->bkhd", ds, q.astype(jnp.float32)) * scale

        def per_kv_head(x):   # GQA: a K/V head's gradient sums its group's query heads
            return x.reshape(x.shape[:2] + (x.shape[2] // group, group) + x.shape[3:]).sum(3)
        return dq.astype(q.dtype), per_kv_head(dk).astype(k.dtype), per_kv_head(dv).astype(v.dtype)

    return forward, backward


def run_case(world: int, options: dict, with_sink: bool, seed: int) -> dict:
    devices = jax.devices("cpu")[:world]
    mesh = Mesh(numpy.array(devices), ("ring",))
    batch, seqlen, heads, heads_kv, d = 2, 64 * world, 4, 2, 32
    rng = numpy.random.default_rng(seed)
    q, k, v, w = (rng.standard_normal((batch, seqlen, h, d)).astype(numpy.float32)
                  for h in (heads, heads_kv, heads_kv, heads))
    sink = (rng.standard_normal(heads) * 2).astype(numpy.float32) if with_sink else None
    zigzag = options.get("causal") or options.get("window_size") is not None
    index = zigzag_indices(seqlen, world) if zigzag else numpy.arange(seqlen)
    back = numpy.argsort(index)
    spec = P(None, "ring")
    sharding = NamedSharding(mesh, spec)
    qz, kz, vz, wz = (jax.device_put(jnp.asarray(x[:, index]), sharding) for x in (q, k, v, w))
    if with_sink:
        def attend(q, k, v, sink):
            return jax_adapter.ring_attention(q, k, v, "ring", sink=sink, **options)
        ring = jax_adapter.shard_map(attend, mesh, (spec, spec, spec, P()), spec)
        args = (qz, kz, vz, jnp.asarray(sink))
    else:
        def attend(q, k, v):
            return jax_adapter.ring_attention(q, k, v, "ring", **options)
        ring = jax_adapter.shard_map(attend, mesh, (spec,) * 3, spec)
        args = (qz, kz, vz)
    o = numpy.asarray(jax.jit(ring)(*args))[:, back]

    def loss(*args):
        return (ring(*args) * wz).sum()

    grads = [numpy.asarray(g) for g in jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))(*args)]
    grads = [g[:, back] for g in grads[:3]] + grads[3:]
    features = dict(options, **({"sink": sink} if with_sink else {}))
    exact_o = attention_reference(q.astype(numpy.float64), k.astype(numpy.float64), v.astype(numpy.float64),
                                  **features)[0]
    exact = attention_reference_backward(w.astype(numpy.float64), q.astype(numpy.float64), k.astype(numpy.float64),
                                         v.astype(numpy.float64), **features)
    errors = {"o": float(numpy.abs(o - exact_o).max() / max(1.0, numpy.abs(exact_o).max()))}
    for name, ours, ref in zip(("dq", "dk", "dv", "dsink"), grads, exact):
        ref = numpy.asarray(ref)
        errors[name] = float(numpy.abs(ours - ref).max() / max(1.0, numpy.abs(ref).max()))
    return errors


CASES = [
    (2, dict(causal=False), False),
    (4, dict(causal=True), False),
    (4, dict(causal=True, window_size=(70, 0), softcap=5.0), False),
    (3, dict(causal=False, window_size=(50, 40)), True),
    (4, dict(causal=True), True),
]

def main(argv: list[str]) -> int:
    jax_adapter._calls = dense_calls   # the kernels' calls, replaced (the ring looks them up when built)
    jax_adapter._ring.cache_clear()
    for n, (world, options, with_sink) in enumerate(CASES):
        errors = run_case(world, options, with_sink, seed=n)
        print(json.dumps({"world": world, "options": {k: list(v) if isinstance(v, tuple) else v
                                                       for k, v in options.items()},
                          "sink": with_sink, "errors": errors}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
