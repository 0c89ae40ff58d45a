"""CPU: the dense reference against first principles (a naive softmax formula, finite differences)."""

import math

import ml_dtypes
import numpy
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cupy_flash import attention_reference, attention_reference_backward
from cupy_flash.reference import round_to_dtype
from helpers import random_array


def naive_attention(q, k, v, scale, causal):
    """Textbook formula, one query at a time, in Python floats."""
    batch, seqlen_q, heads, dim = q.shape
    seqlen_k = k.shape[1]
    o = numpy.zeros((batch, seqlen_q, heads, dim))
    lse = numpy.full((batch, heads, seqlen_q), -numpy.inf)
    for b in range(batch):
        for h in range(heads):
            for i in range(seqlen_q):
                keys = [j for j in range(seqlen_k) if not causal or j <= i + seqlen_k - seqlen_q]
                if not keys:
                    continue
                scores = [scale * float(numpy.dot(q[b, i, h], k[b, j, h])) for j in keys]
                top = max(scores)
                weights = [math.exp(s - top) for s in scores]
                total = sum(weights)
                lse[b, h, i] = top + math.log(total)
                for w, j in zip(weights, keys):
                    o[b, i, h] += w / total * v[b, j, h]
    return o, lse


@given(seqlen_q=st.integers(1, 9), seqlen_k=st.integers(1, 9), causal=st.booleans(),
       dim=st.sampled_from([1, 3, 8]), scale=st.floats(0.05, 3.0), seed=st.integers(0, 2**31))
def test_reference_matches_naive_formula(seqlen_q, seqlen_k, causal, dim, scale, seed):
    rng = numpy.random.default_rng(seed)
    q, k, v = (rng.standard_normal((2, n, 2, dim)) for n in (seqlen_q, seqlen_k, seqlen_k))
    o, lse = attention_reference(q, k, v, softmax_scale=scale, causal=causal)
    o_naive, lse_naive = naive_attention(q, k, v, scale, causal)
    numpy.testing.assert_allclose(o, o_naive, rtol=1e-12, atol=1e-12)
    assert numpy.array_equal(numpy.isinf(lse), numpy.isinf(lse_naive))
    numpy.testing.assert_allclose(lse[numpy.isfinite(lse)], lse_naive[numpy.isfinite(lse_naive)], rtol=1e-12)


def test_rows_that_see_no_key_give_zero_output_and_minus_inf_lse():
    rng = numpy.random.default_rng(1)
    q = rng.standard_normal((1, 5, 1, 4))
    k = v = rng.standard_normal((1, 2, 1, 4))
    o, lse = attention_reference(q, k, v, causal=True)   # queries 0..2 see no key (bottom-right)
    assert numpy.all(o[0, :3] == 0) and numpy.all(numpy.isneginf(lse[0, 0, :3]))
    assert numpy.all(numpy.isfinite(lse[0, 0, 3:]))
    grads = attention_reference_backward(rng.standard_normal(q.shape), q, k, v, causal=True)
    assert all(numpy.isfinite(g).all() for g in grads)
    assert numpy.all(grads[0][0, :3] == 0)


@given(seqlen_q=st.integers(1, 6), seqlen_k=st.integers(1, 6), causal=st.booleans(),
       scale=st.floats(0.1, 2.0), seed=st.integers(0, 2**31))
def test_reference_backward_matches_finite_differences(seqlen_q, seqlen_k, causal, scale, seed):
    rng = numpy.random.default_rng(seed)
    q, k, v = (rng.standard_normal((1, n, 2, 3)) for n in (seqlen_q, seqlen_k, seqlen_k))
    do = rng.standard_normal(q.shape)

    def loss(q_, k_, v_):
        return float((attention_reference(q_, k_, v_, softmax_scale=scale, causal=causal)[0] * do).sum())

    grads = attention_reference_backward(do, q, k, v, softmax_scale=scale, causal=causal)
    eps = 1e-6
    for which, (x, grad) in enumerate(zip((q, k, v), grads)):
        numeric = numpy.zeros_like(x)
        for index in numpy.ndindex(x.shape):
            plus, minus = [a.copy() for a in (q, k, v)], [a.copy() for a in (q, k, v)]
            plus[which][index] += eps
            minus[which][index] -= eps
            numeric[index] = (loss(*plus) - loss(*minus)) / (2 * eps)
        numpy.testing.assert_allclose(grad, numeric, rtol=1e-5, atol=1e-7)


def test_low_precision_reference_rounds_each_stage():
    rng = numpy.random.default_rng(2)
    for dtype in (numpy.float16, ml_dtypes.bfloat16):
        q, k, v = (random_array(rng, (1, 33, 2, 16), dtype, xp=numpy) for _ in range(3))
        o_low, _ = attention_reference(q, k, v, upcast=False)
        # The low-precision output holds values of the input dtype...
        assert numpy.array_equal(o_low, o_low.astype(dtype).astype(numpy.float32))
        # ...and is close to, but not equal to, the exact one.
        o_exact, _ = attention_reference(q, k, v)
        err = numpy.abs(o_low - o_exact).max()
        assert 0 < err < 0.05


@pytest.mark.parametrize("dtype", [numpy.float16, ml_dtypes.bfloat16])
def test_round_to_dtype_matches_numpy_casts(dtype):
    rng = numpy.random.default_rng(3)
    x = numpy.concatenate([rng.standard_normal(10000).astype(numpy.float32) * 100,
                           numpy.array([0.0, -0.0, numpy.inf, -numpy.inf, 1e-30, 65504.0, 3.0e38], numpy.float32)])
    with numpy.errstate(over="ignore"):
        expected = x.astype(dtype).astype(numpy.float32)
    got = round_to_dtype(x, dtype, numpy)
    assert numpy.array_equal(got, expected)
    assert numpy.isnan(round_to_dtype(numpy.array([numpy.nan], numpy.float32), dtype, numpy)).all()
