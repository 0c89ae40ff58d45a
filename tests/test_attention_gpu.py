"""GPU: forward and backward against the float64 dense reference, with the 2x error rule.

Outputs (and every workspace) are NaN-poisoned before each launch. Shapes are drawn to break
kernels: seqlen 1, seqlens that are not multiples of any tile, seqlen_q != seqlen_k (both ways,
so causal rows that see no key occur), every head_dim, logits in the hundreds."""

import numpy
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import cupy_flash
from cupy_flash import attention_reference, attention_reference_backward
from helpers import (DTYPES, NOTES, as_float64, bitwise, check_error_rule, count_example, gradient_term_scales,
                     max_finite_abs,
                     poisoned_allocations, random_array, requires_gpu)

pytestmark = requires_gpu

# Dense float64 reference: keep batch * heads * seqlen_q * seqlen_k (scores per tensor) bounded.
MAX_SCORES = 24_000_000


@st.composite
def problems(draw):
    seqlen = st.one_of(st.integers(1, 200), st.integers(200, 1200), st.integers(1200, 3000))
    seqlen_q, seqlen_k = draw(seqlen), draw(seqlen)
    batch = draw(st.integers(1, 3))
    heads = draw(st.integers(1, 4))
    while batch * heads * seqlen_q * seqlen_k > MAX_SCORES and batch * heads > 1:
        batch, heads = max(1, batch // 2), max(1, heads - 1)
    # Variants, in any combination, half the time (GQA/MQA independently).
    heads_kv = draw(st.sampled_from([n for n in range(1, heads + 1) if heads % n == 0]))
    features = {}
    if draw(st.booleans()):
        if draw(st.booleans()):
            size = st.one_of(st.just(-1), st.integers(0, 40), st.integers(40, 1500))
            features["window_size"] = (draw(size), draw(size))
        if draw(st.booleans()):
            features["softcap"] = draw(st.sampled_from([0.5, 5.0, 30.0]))
        if draw(st.booleans()):
            per_batch = draw(st.booleans())
            features["alibi_slopes"] = draw(st.lists(st.sampled_from([2.0**-e for e in range(9)]),
                                                     min_size=batch * heads if per_batch else heads,
                                                     max_size=batch * heads if per_batch else heads))
            features["alibi_per_batch"] = per_batch
        if draw(st.booleans()):
            features["sink"] = draw(st.lists(st.floats(-8.0, 8.0), min_size=heads, max_size=heads))
    return dict(features=features, heads_kv=heads_kv,
        dtype=draw(st.sampled_from(sorted(DTYPES))),
        batch=batch, heads=heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
        head_dim=8 * draw(st.integers(1, 32)),
        causal=draw(st.booleans()),
        softmax_scale=draw(st.one_of(st.none(), st.floats(0.01, 2.0))),
        # Standard deviation of the scaled logits q.k * scale: at 300 the largest reach about a
        # thousand and the softmax is near one-hot.
        logit_std=draw(st.sampled_from([0.3, 1.0, 3.0, 30.0, 300.0])),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def describe(p):
    variant = {n: x for n, x in p.get("features", {}).items() if n != "alibi_per_batch"}
    return ("{dtype} b={batch} h={heads} h_kv={heads_kv} nq={seqlen_q} nk={seqlen_k} d={head_dim} causal={causal} "
            "scale={softmax_scale} logit_std={logit_std} seed={seed}").format(**{"heads_kv": p["heads"], **p}) + (
        f" {variant}" if variant else "")


def input_magnitude(p):
    """Std of q and k entries that gives scaled logits of std p['logit_std'] (q.k has std
    magnitude^2 * sqrt(head_dim))."""
    scale = p["softmax_scale"] or p["head_dim"] ** -0.5
    return (p["logit_std"] / (scale * p["head_dim"] ** 0.5)) ** 0.5


def make_inputs(p, with_grad=False):
    rng = numpy.random.default_rng(p["seed"])
    q_shape = (p["batch"], p["seqlen_q"], p["heads"], p["head_dim"])
    kv_shape = (p["batch"], p["seqlen_k"], p.get("heads_kv", p["heads"]), p["head_dim"])
    q = random_array(rng, q_shape, p["dtype"], input_magnitude(p))
    k = random_array(rng, kv_shape, p["dtype"], input_magnitude(p))
    v = random_array(rng, kv_shape, p["dtype"])
    if not with_grad:
        return q, k, v
    return q, k, v, random_array(rng, q_shape, p["dtype"])


def options(p):
    import cupy

    result = dict(softmax_scale=p["softmax_scale"], causal=p["causal"])
    features = dict(p.get("features", {}))
    per_batch = features.pop("alibi_per_batch", False)
    if "alibi_slopes" in features:
        slopes = cupy.asarray(features["alibi_slopes"], dtype=cupy.float32)
        features["alibi_slopes"] = slopes.reshape(p["batch"], p["heads"]) if per_batch else slopes
    if "sink" in features:
        features["sink"] = cupy.asarray(features["sink"], dtype=cupy.float32)
    result.update(features)
    return result


EDGE_CASES = [
    dict(dtype="float16", batch=1, heads=1, seqlen_q=1, seqlen_k=1, head_dim=8, causal=False, softmax_scale=None, logit_std=1.0, seed=1),
    dict(dtype="bfloat16", batch=2, heads=3, seqlen_q=1, seqlen_k=777, head_dim=128, causal=True, softmax_scale=None, logit_std=1.0, seed=2),
    dict(dtype="float32", batch=1, heads=2, seqlen_q=513, seqlen_k=31, head_dim=256, causal=True, softmax_scale=None, logit_std=10.0, seed=3),
    dict(dtype="bfloat16", batch=1, heads=1, seqlen_q=65, seqlen_k=65, head_dim=72, causal=True, softmax_scale=0.5, logit_std=300.0, seed=4),
    # float32 with logits near a thousand: rounding scores before exp2 once cost 2.4x the dense error.
    dict(dtype="float32", batch=1, heads=3, seqlen_q=1823, seqlen_k=1200, head_dim=192, causal=False, softmax_scale=0.2665420828873906, logit_std=300.0, seed=3),
    # One key, huge logits: the dense reference is exact (P = 1); only the lse floor term allows ours.
    dict(dtype="float32", batch=1, heads=1, seqlen_q=1, seqlen_k=1, head_dim=24, causal=False, softmax_scale=None, logit_std=300.0, seed=0),
    # One key, many queries: exact dK = 0, ours is float32 cancellation noise (the term-scale floor).
    dict(dtype="float16", batch=2, heads=2, seqlen_q=125, seqlen_k=1, head_dim=24, causal=False, softmax_scale=None, logit_std=30.0, seed=1),
    # Every variant at once, MQA: window left of 100 under causal, softcap, ALiBi, a sink per head.
    dict(dtype="bfloat16", batch=2, heads=4, heads_kv=1, seqlen_q=300, seqlen_k=700, head_dim=64, causal=True,
         softmax_scale=None, logit_std=3.0, seed=7,
         features={"window_size": (100, -1), "softcap": 5.0, "alibi_slopes": [0.5, 0.25, 0.125, 0.0625], "sink": [0.0, 1.0, -2.0, 3.0]}),
    # Window (0, 0): each query sees exactly its diagonal key; with seqlen_q > seqlen_k the first rows see none.
    dict(dtype="float16", batch=1, heads=2, heads_kv=2, seqlen_q=700, seqlen_k=300, head_dim=128, causal=False,
         softmax_scale=None, logit_std=1.0, seed=8, features={"window_size": (0, 0)}),
    # float32 (CUDA-core kernels), GQA 3:1, window and per-batch ALiBi slopes.
    dict(dtype="float32", batch=2, heads=3, heads_kv=1, seqlen_q=200, seqlen_k=333, head_dim=40, causal=False,
         softmax_scale=None, logit_std=3.0, seed=9,
         features={"window_size": (20, 50), "alibi_slopes": [0.5, 0.25, 0.125, 1.0, 0.03, 0.0], "alibi_per_batch": True}),
    # One query, three keys: dq 2.3x the low-precision error while that reference kept delta in
    # float32 (a dense bf16 softmax backward rounds it; the reference now does too).
    dict(dtype="bfloat16", batch=3, heads=1, seqlen_q=1, seqlen_k=3, head_dim=8, causal=False, softmax_scale=None,
         logit_std=1.0, seed=0),
]


def _check_forward(p):
    q, k, v = make_inputs(p)
    with poisoned_allocations():
        o, lse = cupy_flash.flash_forward(q, k, v, **options(p))
    assert o.shape == q.shape and o.dtype == q.dtype
    assert lse.shape == (p["batch"], p["heads"], p["seqlen_q"]) and lse.dtype == numpy.float32
    o_exact, lse_exact = attention_reference(q, k, v, **options(p))
    o_low, lse_low = attention_reference(q, k, v, upcast=False, **options(p))
    context = describe(p)
    lse_magnitude = max_finite_abs(lse_exact)
    check_error_rule("o", o, o_exact, o_low, context, lse_magnitude)
    check_error_rule("lse", lse, lse_exact, lse_low, context, lse_magnitude)
    assert cupy_flash.flash_attention(q, k, v, **options(p)).shape == q.shape


@given(problems())
@example(EDGE_CASES[0])
@example(EDGE_CASES[1])
@example(EDGE_CASES[2])
@example(EDGE_CASES[3])
@example(EDGE_CASES[4])
@example(EDGE_CASES[5])
@example(EDGE_CASES[7])
@example(EDGE_CASES[8])
@example(EDGE_CASES[9])
def test_forward_matches_reference(p):
    count_example("forward_matches_reference")
    _check_forward(p)


def _check_backward(p, deterministic):
    q, k, v, do = make_inputs(p, with_grad=True)
    o, lse = cupy_flash.flash_forward(q, k, v, **options(p))
    with poisoned_allocations():
        grads = cupy_flash.flash_backward(do, q, k, v, o, lse, deterministic=deterministic, **options(p))
    exact = attention_reference_backward(do, q, k, v, **options(p))
    low = attention_reference_backward(do, q, k, v, upcast=False, **options(p))
    context = describe(p) + f" deterministic={deterministic}"
    lse_magnitude = max_finite_abs(lse)
    term_scales = gradient_term_scales(do, q, k, v, **options(p))
    assert len(grads) == len(exact) == (4 if "sink" in p.get("features", {}) else 3)
    for name, ours, x, e, lo in zip(("dq", "dk", "dv"), grads, (q, k, v), exact, low):
        assert ours.shape == x.shape and ours.dtype == x.dtype
        check_error_rule(name, ours, e, lo, context, lse_magnitude, term_scales[name])
    if len(grads) == 4:   # dsink: a float32 sum over batch and rows of P_sink * delta
        check_error_rule("dsink", grads[3], exact[3], low[3], context, lse_magnitude,
                         float(abs(exact[3]).max()) * p["batch"] * p["seqlen_q"])


@given(problems(), st.booleans())
@example(EDGE_CASES[0], False)
@example(EDGE_CASES[1], True)
@example(EDGE_CASES[2], False)
@example(EDGE_CASES[3], True)
@example(EDGE_CASES[4], False)
@example(EDGE_CASES[5], False)
@example(EDGE_CASES[6], False)
@example(EDGE_CASES[7], True)
@example(EDGE_CASES[8], False)
@example(EDGE_CASES[9], True)
@example(EDGE_CASES[10], False)
def test_backward_matches_reference(p, deterministic):
    count_example("backward_matches_reference")
    _check_backward(p, deterministic)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, (300, 200)], ids=["plain", "window-gqa"])
def test_deterministic_backward_is_bitwise_reproducible(dtype, causal, window):
    # The window makes each query block's key blocks a range that does not start at 0: the
    # ordered adds must count turns from the range's start.
    p = dict(dtype=dtype, batch=2, heads=3, seqlen_q=1000, seqlen_k=1100, head_dim=64, causal=causal,
             softmax_scale=None, logit_std=1.0, seed=11, heads_kv=3 if window is None else 1)
    q, k, v, do = make_inputs(p, with_grad=True)
    opts = dict(causal=causal, window_size=window)
    o, lse = cupy_flash.flash_forward(q, k, v, **opts)
    first = cupy_flash.flash_backward(do, q, k, v, o, lse, deterministic=True, **opts)
    for _ in range(3):
        again = cupy_flash.flash_backward(do, q, k, v, o, lse, deterministic=True, **opts)
        for a, b in zip(first, again):
            assert bool((bitwise(a) == bitwise(b)).all())
    # The atomic path computes the same gradients up to summation order.
    atomic = cupy_flash.flash_backward(do, q, k, v, o, lse, **opts)
    for a, b in zip(first, atomic):
        assert float(abs(as_float64(a) - as_float64(b)).max()) <= 0.02 * float(abs(as_float64(a)).max())


@pytest.mark.parametrize("causal", [False, True])
def test_thousands_of_batch_heads(causal):
    p = dict(dtype="bfloat16", batch=48, heads=64, seqlen_q=37, seqlen_k=70, head_dim=64, causal=causal,
             softmax_scale=None, logit_std=1.0, seed=5)
    _check_forward(p)
    _check_backward(p, deterministic=False)


def test_rows_that_see_no_key():
    # Bottom-right causal with seqlen_q > seqlen_k: the first seqlen_q - seqlen_k rows see nothing.
    p = dict(dtype="float16", batch=1, heads=2, seqlen_q=300, seqlen_k=100, head_dim=64, causal=True,
             softmax_scale=None, logit_std=1.0, seed=6)
    q, k, v, do = make_inputs(p, with_grad=True)
    o, lse = cupy_flash.flash_forward(q, k, v, causal=True)
    assert bool((o[:, :200] == 0).all()) and bool(numpy.isneginf(lse[:, :, :200].get()).all())
    for deterministic in (False, True):
        dq, dk, dv = cupy_flash.flash_backward(do, q, k, v, o, lse, causal=True, deterministic=deterministic)
        assert bool((dq[:, :200] == 0).all())
        for g in (dq, dk, dv):
            assert not bool(numpy.isnan(g.get().astype(numpy.float32)).any())


def test_strided_and_misaligned_views_are_copied_not_misread():
    import cupy

    rng = numpy.random.default_rng(7)
    base = random_array(rng, (2, 90, 6, 64), "float16")
    q = base[:, :, ::2]                                   # heads strided: not contiguous
    flat = random_array(rng, (2 * 90 * 3 * 64 + 1,), "float16")
    k = flat[1:].reshape(2, 90, 3, 64)                    # contiguous but 2 bytes off alignment
    v = cupy.ascontiguousarray(base[:, :, 1::2])
    o, lse = cupy_flash.flash_forward(q, k, v)
    o_ref, _ = attention_reference(q, k, v)
    o_low, _ = attention_reference(q, k, v, upcast=False)
    check_error_rule("o", o, o_ref, o_low, "strided views")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_torch_tensors_through_dlpack(dtype):
    torch = pytest.importorskip("torch")
    import cupy

    torch_dtype = getattr(torch, dtype)
    q, k, v = (torch.randn(2, 129, 4, 64, device="cuda", dtype=torch_dtype) for _ in range(3))
    o, lse = cupy_flash.flash_forward(q, k, v, causal=True)
    assert isinstance(o, cupy.ndarray) and o.dtype == DTYPES[dtype]
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)
    assert float((torch.from_dlpack(o).float() - expected.float()).abs().max()) < 2e-2


def test_jax_arrays_through_dlpack():
    import os

    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # leave the GPU to CuPy
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX sees no GPU")
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(key, (1, 77, 2, 32), dtype=jnp.float16) for key in keys)
    o, _ = cupy_flash.flash_forward(q, k, v)
    o_ref, _ = attention_reference(*(numpy.asarray(x) for x in (q, k, v)))
    assert float(abs(numpy.asarray(jnp.from_dlpack(o)).astype(numpy.float64) - o_ref).max()) < 2e-3


def test_memory_is_linear_in_seqlen():
    """Peak pool usage of a forward + backward at 16k and 32k tokens stays a fixed multiple of the
    input size: no O(seqlen^2) buffer (at 32k a single float32 (heads, seqlen, seqlen / 64) buffer
    would already be 16 inputs' worth)."""
    import cupy

    pool = cupy.get_default_memory_pool()
    for seqlen in (16384, 32768):
        p = dict(dtype="bfloat16", batch=1, heads=4, seqlen_q=seqlen, seqlen_k=seqlen, head_dim=64,
                 causal=True, softmax_scale=None, logit_std=1.0, seed=8)
        q, k, v, do = make_inputs(p, with_grad=True)
        cupy.cuda.Device().synchronize()
        pool.free_all_blocks()
        baseline = pool.total_bytes()
        o, lse = cupy_flash.flash_forward(q, k, v, causal=True)
        grads = cupy_flash.flash_backward(do, q, k, v, o, lse, causal=True)
        cupy.cuda.Device().synchronize()
        extra = pool.total_bytes() - baseline
        # o, lse, delta, dq, dk, dv and the float32 dq accumulator: about 6 inputs' worth.
        NOTES.append(f"memory: seqlen {seqlen}: forward+backward peak pool growth {extra / 2**20:.1f} MiB "
                     f"= {extra / q.nbytes:.2f} x one input ({q.nbytes / 2**20:.1f} MiB)")
        assert extra <= 8 * q.nbytes, (seqlen, extra, q.nbytes)
        del o, lse, grads, q, k, v, do
