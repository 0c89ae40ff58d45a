"""CPU: the dense reference against first principles (a naive softmax formula, finite differences)."""

import functools
import math

import ml_dtypes
import numpy
import pytest
from helpers import random_array
from hypothesis import given
from hypothesis import strategies as st

from cupy_flash import attention_reference, attention_reference_backward
from cupy_flash.reference import round_to_dtype


def naive_attention(q, k, v, scale, causal, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sink=None,
                    bias=None):
    """Textbook formula, one query at a time, in Python floats, with every variant spelled out."""
    batch, seqlen_q, heads, dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    shift = seqlen_k - seqlen_q
    left, right = window_size
    o = numpy.zeros((batch, seqlen_q, heads, dim))
    lse = numpy.full((batch, heads, seqlen_q), -numpy.inf)
    if bias is not None:
        bias = numpy.broadcast_to(bias, (batch, heads, seqlen_q, seqlen_k))
    for b in range(batch):
        for h in range(heads):
            hk = h // (heads // heads_kv)
            for i in range(seqlen_q):
                keys = [j for j in range(seqlen_k)
                        if (not causal or j <= i + shift) and (right < 0 or j <= i + shift + right)
                        and (left < 0 or j >= i + shift - left)]
                scores = []
                for j in keys:
                    x = scale * float(numpy.dot(q[b, i, h], k[b, j, hk]))
                    if softcap:
                        x = softcap * math.tanh(x / softcap)
                    if alibi_slopes is not None:
                        slope = alibi_slopes[h] if alibi_slopes.ndim == 1 else alibi_slopes[b, h]
                        x -= slope * abs(i + shift - j)
                    if bias is not None:
                        x += float(bias[b, h, i, j])
                    scores.append(x)
                logits = scores + ([float(sink[h])] if sink is not None else [])
                if not logits or max(logits) == -math.inf:
                    continue
                top = max(logits)
                total = sum(math.exp(x - top) for x in logits)
                lse[b, h, i] = top + math.log(total)
                for x, j in zip(scores, keys):
                    o[b, i, h] += math.exp(x - top) / total * v[b, j, hk]
    return o, lse


# Axes of (batch, heads, seqlen_q, seqlen_k) a drawn bias keeps (True), broadcasts (False) or lacks (None).
BIAS_AXES = [(True, True, True, True), (None, True, True, True), (None, None, True, True), (True, False, False, True),
             (True, True, True, False), (None, None, None, True)]


def make_bias(axes, full, rng, masked=False):
    shape = tuple(n if keep else 1 for n, keep in zip(full, axes) if keep is not None)
    bias = rng.standard_normal(shape)
    if masked:
        bias[rng.random(shape) < 0.3] = -numpy.inf
    return bias


@st.composite
def variants(draw, batch, heads):
    """Feature keywords in any combination (possibly none); a bias as its axes ("bias_axes")."""
    features = {}
    if draw(st.booleans()):
        features["window_size"] = (draw(st.integers(-1, 4)), draw(st.integers(-1, 4)))
    if draw(st.booleans()):
        features["softcap"] = draw(st.sampled_from([0.5, 2.0]))
    if draw(st.booleans()):
        shape = (heads,) if draw(st.booleans()) else (batch, heads)
        features["alibi_slopes"] = numpy.array(draw(st.lists(st.floats(0.0, 1.0), min_size=math.prod(shape),
                                                             max_size=math.prod(shape)))).reshape(shape)
    if draw(st.booleans()):
        features["sink"] = numpy.array(draw(st.lists(st.floats(-3.0, 3.0), min_size=heads, max_size=heads)))
    if draw(st.booleans()):
        features["bias_axes"] = draw(st.sampled_from(BIAS_AXES))
    return features


@given(seqlen_q=st.integers(1, 9), seqlen_k=st.integers(1, 9), causal=st.booleans(),
       dim=st.sampled_from([1, 3, 8]), scale=st.floats(0.05, 3.0), heads_kv=st.sampled_from([1, 2, 4]),
       seed=st.integers(0, 2**31), features=variants(2, 4))
def test_reference_matches_naive_formula(seqlen_q, seqlen_k, causal, dim, scale, heads_kv, seed, features):
    rng = numpy.random.default_rng(seed)
    q = rng.standard_normal((2, seqlen_q, 4, dim))
    k, v = (rng.standard_normal((2, seqlen_k, heads_kv, dim)) for _ in range(2))
    if "bias_axes" in features:   # masks included: -inf entries
        features["bias"] = make_bias(features.pop("bias_axes"), (2, 4, seqlen_q, seqlen_k), rng, masked=seed % 2 == 0)
    o, lse = attention_reference(q, k, v, softmax_scale=scale, causal=causal, **features)
    o_naive, lse_naive = naive_attention(q, k, v, scale, causal, **features)
    numpy.testing.assert_allclose(o, o_naive, rtol=1e-12, atol=1e-12)
    assert numpy.array_equal(numpy.isinf(lse), numpy.isinf(lse_naive))
    # A floor as o's: lse is a difference (max + log of a sum) that can land near 0, where a relative
    # tolerance alone failed on a last-bit difference (-3.2e-4, 3.9e-16 apart, with a sink).
    numpy.testing.assert_allclose(lse[numpy.isfinite(lse)], lse_naive[numpy.isfinite(lse_naive)], rtol=1e-12, atol=1e-12)


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
       scale=st.floats(0.1, 2.0), heads_kv=st.sampled_from([1, 2]), seed=st.integers(0, 2**31),
       features=variants(1, 2))
def test_reference_backward_matches_finite_differences(seqlen_q, seqlen_k, causal, scale, heads_kv, seed, features):
    rng = numpy.random.default_rng(seed)
    q = rng.standard_normal((1, seqlen_q, 2, 3))
    k, v = (rng.standard_normal((1, seqlen_k, heads_kv, 3)) for _ in range(2))
    do = rng.standard_normal(q.shape)
    sink = features.pop("sink", None)
    axes = features.pop("bias_axes", None)
    bias = None if axes is None else make_bias(axes, (1, 2, seqlen_q, seqlen_k), rng)
    inputs = [q, k, v] + ([sink] if sink is not None else []) + ([bias] if bias is not None else [])

    def extras(rest):
        rest = list(rest)
        extra = {"sink": rest.pop(0)} if sink is not None else {}
        if bias is not None:
            extra["bias"] = rest.pop(0)
        return extra

    def loss(q_, k_, v_, *rest):
        return float((attention_reference(q_, k_, v_, softmax_scale=scale, causal=causal, **features, **extras(rest))[0]
                      * do).sum())

    grads = attention_reference_backward(do, q, k, v, softmax_scale=scale, causal=causal, **features,
                                         **extras(inputs[3:]), return_dbias=bias is not None)
    assert len(grads) == len(inputs)
    eps = 1e-6
    for which, (x, grad) in enumerate(zip(inputs, grads)):
        numeric = numpy.zeros_like(x)
        for index in numpy.ndindex(x.shape):
            plus, minus = [a.copy() for a in inputs], [a.copy() for a in inputs]
            plus[which][index] += eps
            minus[which][index] -= eps
            numeric[index] = (loss(*plus) - loss(*minus)) / (2 * eps)
        numpy.testing.assert_allclose(grad, numeric, rtol=1e-5, atol=1e-7)


def test_packed_reference_is_the_dense_reference_per_sequence():
    rng = numpy.random.default_rng(5)
    lens_q, lens_k = [3, 0, 5], [4, 2, 0]
    q = rng.standard_normal((sum(lens_q), 2, 4))
    k, v = (rng.standard_normal((sum(lens_k), 1, 4)) for _ in range(2))
    cu_q, cu_k = numpy.cumsum([0] + lens_q).astype(numpy.int32), numpy.cumsum([0] + lens_k).astype(numpy.int32)
    slopes = rng.random((3, 2))
    o, lse = attention_reference(q, k, v, causal=True, alibi_slopes=slopes, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert o.shape == q.shape and lse.shape == (2, sum(lens_q))
    for b in range(3):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        o_b, lse_b = naive_attention(q[None, rq], k[None, rk], v[None, rk], 0.5, True, alibi_slopes=slopes[b])
        numpy.testing.assert_allclose(o[rq], o_b[0], atol=1e-12)
        assert numpy.array_equal(lse[:, rq], lse_b[0]) or numpy.allclose(lse[:, rq], lse_b[0], rtol=1e-12)
    assert numpy.all(numpy.isneginf(lse[:, cu_q[2]:]))   # the third sequence has no keys
    do = rng.standard_normal(q.shape)
    dq, dk, dv = attention_reference_backward(do, q, k, v, causal=True, alibi_slopes=slopes, cu_seqlens_q=cu_q,
                                              cu_seqlens_k=cu_k)
    assert dq.shape == q.shape and dk.shape == k.shape and numpy.all(dq[cu_q[2]:] == 0)
    numpy.testing.assert_allclose(dk[cu_k[0]:cu_k[1]], attention_reference_backward(
        do[None, :3], q[None, :3], k[None, :4], v[None, :4], causal=True, alibi_slopes=slopes[0])[1][0])


def test_paged_reference_reads_keys_through_the_block_table():
    """A packed batch with block_table (flash_forward's paged K/V): each sequence's keys are gathered
    from its pages, so the result equals the packed reference on contiguous keys; a page of NaN that
    no table names is never read, and the backward refuses the table."""
    rng = numpy.random.default_rng(8)
    lens_q, lens_k, page_size = [3, 1, 4], [20, 0, 33], 16
    q = rng.standard_normal((sum(lens_q), 2, 8))
    k, v = (rng.standard_normal((sum(lens_k), 1, 8)) for _ in range(2))
    cu_q, cu_k = numpy.cumsum([0] + lens_q).astype(numpy.int32), numpy.cumsum([0] + lens_k).astype(numpy.int32)
    table = numpy.array([[4, 0, 6], [6, 6, 6], [2, 5, 1]], numpy.int32)   # pages of sequence 0: 4, 0; 2: 2, 5, 1
    k_cache, v_cache = (numpy.full((7, page_size, 1, 8), numpy.nan) for _ in range(2))   # page 3 and 6 never hold keys
    for cache, rows in ((k_cache, k), (v_cache, v)):
        for b in (0, 2):
            keys = rows[cu_k[b]:cu_k[b + 1]]
            for j, page in enumerate(table[b, :-(-len(keys) // page_size)]):
                part = keys[j * page_size:(j + 1) * page_size]
                cache[page, :len(part)] = part
    options = dict(causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    o, lse = attention_reference(q, k_cache, v_cache, block_table=table, **options)
    o_packed, lse_packed = attention_reference(q, k, v, **options)
    assert numpy.array_equal(o, o_packed) and numpy.array_equal(lse, lse_packed)
    with pytest.raises(ValueError, match="block_table names a page outside k's 7"):
        attention_reference(q, k_cache, v_cache, block_table=table + 2, **options)
    with pytest.raises(ValueError, match="block_table is not supported by attention_reference_backward"):
        attention_reference_backward(q, q, k_cache, v_cache, block_table=table, **options)


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


@pytest.mark.parametrize("features", [{}, {"sink": numpy.array([0.5, -1.0], numpy.float32)}, {"softcap": 5.0}])
def test_delta_term_leaves_the_rule_tight(features):
    """The error rule's stored-O delta term (helpers.gradient_term_scales) bounds a real FlashAttention
    error, but on ordinary shapes it must stay well under the dense bf16 error it is added to, or the
    rule could no longer fail."""
    from helpers import gradient_term_scales

    rng = numpy.random.default_rng(5)
    q, k, v, do = (random_array(rng, (1, 200, 2, 64), "bfloat16", xp=numpy) for _ in range(4))
    exact = attention_reference_backward(do, q, k, v, **features)
    low = attention_reference_backward(do, q, k, v, upcast=False, **features)
    # With the O a backward is given (here the flash form's: scores and P in float32, O rounded once,
    # as our forward), whose own error the term takes in exactly.
    o = attention_reference(q, k, v, upcast=False, rounding="flash", **features)[0]
    both_scales = (gradient_term_scales(do, q, k, v, **features), gradient_term_scales(do, q, k, v, o=o, **features))
    for index, name in enumerate(("dq", "dk")):
        dense_error = float(numpy.abs(numpy.asarray(low[index], numpy.float64) - exact[index]).max())
        for scales in both_scales:
            assert 0 < scales["delta:" + name] < 0.25 * dense_error, (name, scales["delta:" + name], dense_error)


@pytest.mark.parametrize("features", [{}, {"sink": numpy.array([0.5, -1.0], numpy.float32)}, {"softcap": 5.0},
                                      {"alibi_slopes": numpy.array([0.5, 0.25], numpy.float32)}])
def test_flash_rounding_leaves_the_rule_tight(features):
    """The error rule takes the larger error of the two dense forms (rounding="dense" and "flash");
    on ordinary shapes the flash form (scores and dP kept in float32) must be the more accurate one,
    so the rule there is the dense form's, as before: under 0.8x of it (measured 0.2-0.62x for o
    and the gradients). With ALiBi the gradients come closer (dq 0.83x, dk equal: the same element
    rounds the same way), so there the flash form must only not be the larger."""
    rng = numpy.random.default_rng(5)
    q, k, v, do = (random_array(rng, (1, 200, 2, 64), "bfloat16", xp=numpy) for _ in range(4))
    forms = {}
    for form in ("dense", "flash"):
        forms[form] = (attention_reference(q, k, v, upcast=False, rounding=form, **features)
                       + attention_reference_backward(do, q, k, v, upcast=False, rounding=form, **features))
    exact = attention_reference(q, k, v, **features) + attention_reference_backward(do, q, k, v, **features)
    for index, name in enumerate(("o", "lse", "dq", "dk", "dv")):
        dense_error, flash_error = (float(numpy.abs(numpy.asarray(x[index], numpy.float64) - exact[index]).max())
                                    for x in (forms["dense"], forms["flash"]))
        if "alibi_slopes" in features:
            assert 0 < flash_error <= dense_error, (name, flash_error, dense_error)
        else:
            assert 0 < flash_error < 0.8 * dense_error, (name, flash_error, dense_error)


def test_flash_rounding_of_few_outputs_is_a_lottery():
    """Why the rule needs the flash form: one query, d = 8, bf16 with softcap and ALiBi (the case
    the GPU suite keeps as EDGE_CASES[16]); FlashAttention's own rounding is 4.7x the dense form's
    error there, and so would fail a rule that knew only the dense form."""
    from helpers import input_magnitude

    p = dict(head_dim=8, logit_std=3.0, softmax_scale=None)
    rng = numpy.random.default_rng(167)
    q = random_array(rng, (1, 1, 1, 8), "bfloat16", input_magnitude(p), xp=numpy)
    k = random_array(rng, (1, 70, 1, 8), "bfloat16", input_magnitude(p), xp=numpy)
    v = random_array(rng, (1, 70, 1, 8), "bfloat16", xp=numpy)
    features = dict(softcap=0.5, alibi_slopes=numpy.array([0.0078125], numpy.float32))
    exact = attention_reference(q, k, v, **features)[0]
    dense_error, flash_error = (float(numpy.abs(numpy.asarray(attention_reference(q, k, v, upcast=False, rounding=form,
                                                                                  **features)[0], numpy.float64) - exact).max())
                                for form in ("dense", "flash"))
    assert flash_error > 4 * dense_error


def test_flash_rounding_is_a_low_precision_form_only():
    """upcast=True ignores rounding (float64 is the ground truth either way); an unknown form is a
    ValueError naming it."""
    rng = numpy.random.default_rng(6)
    q, k, v, do = (random_array(rng, (2, 9, 2, 16), "float16", xp=numpy) for _ in range(4))
    for a, b in zip(attention_reference_backward(do, q, k, v, causal=True) + attention_reference(q, k, v, causal=True),
                    attention_reference_backward(do, q, k, v, causal=True, rounding="flash")
                    + attention_reference(q, k, v, causal=True, rounding="flash")):
        assert numpy.array_equal(a, b)
    with pytest.raises(ValueError, match="rounding"):
        attention_reference(q, k, v, upcast=False, rounding="fast")
    with pytest.raises(ValueError, match="rounding"):
        attention_reference_backward(do, q, k, v, upcast=False, rounding="fast")


def test_reference_checks_are_the_kernels_but_wider_as_the_readme_says():
    """docs/api.md: the kernels' argument checks, but any floating dtype (mixed among q, k, v too) and
    sequences of length 0; a misspelled keyword is answered with the name it is closest to."""
    k = numpy.zeros((1, 3, 2, 8), numpy.float64)
    o, lse = attention_reference(numpy.zeros((1, 0, 2, 8), numpy.float32), k, k)
    assert o.shape == (1, 0, 2, 8) and lse.shape == (1, 2, 0)
    q = numpy.ones((1, 2, 2, 8), numpy.float16)
    assert attention_reference(q, k, k)[0].dtype == numpy.float64
    empty = numpy.zeros((1, 0, 2, 8))
    o, lse = attention_reference(q, empty, empty)
    assert (o == 0).all() and (lse == -numpy.inf).all()
    with pytest.raises(TypeError, match="did you mean causal for casual"):
        attention_reference(q, k, k, casual=True)
    with pytest.raises(TypeError, match="xyz") as raised:
        attention_reference(q, k, k, xyz=1)
    assert "did you mean" not in str(raised.value)


def _padded(x, width):
    """x with its last axis padded by zeros to ``width``."""
    pad = [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])]
    return numpy.pad(x, pad)


@pytest.mark.parametrize("d_qk, d_v", [(48, 16), (24, 40), (8, 8), (192 // 8, 128 // 8)])
@pytest.mark.parametrize("upcast, rounding", [(True, "dense"), (False, "dense"), (False, "flash")])
@pytest.mark.parametrize("features", [dict(causal=True), dict(window_size=(5, 2), sink=numpy.array([0.5, -1.0, 0.0, 2.0]))])
def test_head_dim_v_may_differ_from_head_dim(d_qk, d_v, upcast, rounding, features):
    """v (and so o, do, dv) with a head_dim of its own (issue 52: DeepSeek's 192 / 128). Zero columns
    change no score (q, k) and no output column but their own (v), so the reference on q, k, v padded
    to a common head_dim, the scale given, is the same attention: o, lse, dq, dk, dv its slices (to
    the last bits a matrix product's summation order leaves: the padded products block differently).
    GQA 4 / 2; float32 inputs, so the low-precision forms are float32 arithmetic."""
    rng = numpy.random.default_rng(d_qk * 100 + d_v)
    q = rng.standard_normal((2, 11, 4, d_qk)).astype(numpy.float32)
    k = rng.standard_normal((2, 13, 2, d_qk)).astype(numpy.float32)
    v = rng.standard_normal((2, 13, 2, d_v)).astype(numpy.float32)
    do = rng.standard_normal((2, 11, 4, d_v)).astype(numpy.float32)
    width = max(d_qk, d_v)
    options = dict(softmax_scale=1 / math.sqrt(d_qk), upcast=upcast, rounding=rounding, **features)
    o, lse = attention_reference(q, k, v, **options)
    o_wide, lse_wide = attention_reference(_padded(q, width), _padded(k, width), _padded(v, width), **options)
    same = functools.partial(numpy.allclose, rtol=1e-12 if upcast else 2e-6, atol=1e-12 if upcast else 1e-6)
    assert o.shape == (2, 11, 4, d_v)
    assert same(o, o_wide[..., :d_v]) and same(lse, lse_wide)
    grads = attention_reference_backward(do, q, k, v, **options)
    wide = attention_reference_backward(_padded(do, width), _padded(q, width), _padded(k, width), _padded(v, width),
                                        **options)
    for name, ours, padded, d in zip(("dq", "dk", "dv"), grads, wide, (d_qk, d_qk, d_v)):
        assert ours.shape[-1] == d and same(ours, padded[..., :d]), name
    if "sink" in features:
        assert same(grads[3], wide[3])   # dsink


def test_head_dim_v_shapes_are_checked():
    q, k = numpy.zeros((1, 3, 2, 16)), numpy.zeros((1, 5, 2, 16))
    v = numpy.zeros((1, 5, 2, 8))
    with pytest.raises(ValueError, match="v has shape .* but k has shape"):
        attention_reference(q, k, numpy.zeros((1, 4, 2, 8)))
    with pytest.raises(ValueError, match=r"do has shape \(1, 3, 2, 16\); expected o's \(1, 3, 2, 8\)"):
        attention_reference_backward(q, q, k, v)


def test_decode_reference_reads_mla_latent_cache_through_views():
    """MLA decoding (issue 53): one K/V head whose rows are the latent (d_v) followed by the rotary
    part, v the latent, i.e. ``v_cache = k_cache[..., :d_v]`` (a view; nothing copied), paged. The
    reference is attention over each sequence's first cache_seqlens rows with k = the whole row and
    v = its latent, d_qk = 576 and d_v = 512 scaled down here to 72 / 64."""
    from cupy_flash import decode_reference

    rng = numpy.random.default_rng(12)
    batch, heads, page_size, pages, d_qk, d_v = 2, 16, 16, 6, 72, 64
    k_cache = rng.standard_normal((batch * pages, page_size, 1, d_qk))
    table = rng.permutation(batch * pages).reshape(batch, pages).astype(numpy.int32)
    lengths = numpy.array([37, 90], dtype=numpy.int32)
    q = rng.standard_normal((batch, 2, heads, d_qk))   # two new tokens (speculative decoding)
    o, lse = decode_reference(q, k_cache, k_cache[..., :d_v], cache_seqlens=lengths, block_table=table, causal=True)
    assert o.shape == (batch, 2, heads, d_v)
    for b in range(batch):
        rows = numpy.concatenate([k_cache[page] for page in table[b]])[:lengths[b]]
        want, want_lse = attention_reference(q[b:b + 1], rows[None], rows[None, ..., :d_v], causal=True)
        assert numpy.allclose(o[b:b + 1], want, rtol=1e-12, atol=1e-12) and numpy.allclose(lse[b:b + 1], want_lse)


def test_decode_reference_takes_flash_attn_with_kvcache_options():
    """decode_reference's cache_batch_idx / cache_leftpad read each sequence's keys from its own cache
    row and first key; rotary turns q and k_new as documented (pairs, positions), against a direct
    float64 computation within the dtype's rounding."""
    from cupy_flash import decode_reference
    from cupy_flash.reference import rotate

    rng = numpy.random.default_rng(5)
    bf16 = ml_dtypes.bfloat16
    q = rng.standard_normal((2, 3, 4, 16)).astype(bf16)
    pool = rng.standard_normal((3, 40, 2, 16)).astype(bf16)
    lengths, index, leftpad = numpy.array([30, 12], numpy.int32), numpy.array([2, 0], numpy.int32), numpy.array([5, 0], numpy.int32)
    o, lse = decode_reference(q, pool, pool, cache_seqlens=lengths, cache_batch_idx=index, cache_leftpad=leftpad, causal=True)
    for b in range(2):
        keys = pool[index[b], leftpad[b]:lengths[b]][None]
        o_b, lse_b = attention_reference(q[b:b + 1], keys, keys, causal=True)
        assert numpy.array_equal(o[b:b + 1], o_b) and numpy.array_equal(lse[b:b + 1], lse_b)
    # Rotary: GPT-NeoX pairs (i, i + 4) and GPT-J pairs (2i, 2i + 1) over rotary_dim 8 of 16.
    angles = numpy.arange(50)[:, None] * 0.1 * (numpy.arange(4) + 1)[None, :]
    cos, sin = numpy.cos(angles).astype(bf16), numpy.sin(angles).astype(bf16)
    for interleaved in (False, True):
        for moves in (False, True):
            turned = rotate(q, cos, sin, lengths, moves, interleaved).astype(numpy.float64)
            x = q.astype(numpy.float64)
            first = numpy.arange(0, 8, 2) if interleaved else numpy.arange(4)
            second = first + 1 if interleaved else first + 4
            for b in range(2):
                for t in range(3):
                    pos = lengths[b] + (t if moves else 0)
                    c, s = cos[pos].astype(numpy.float64), sin[pos].astype(numpy.float64)
                    expect = x[b, t].copy()
                    expect[:, first] = x[b, t][:, first] * c - x[b, t][:, second] * s
                    expect[:, second] = x[b, t][:, first] * s + x[b, t][:, second] * c
                    assert numpy.allclose(turned[b, t], expect, rtol=2**-7, atol=2**-7)
            assert numpy.array_equal(turned[..., 8:], x[..., 8:])   # columns past rotary_dim: copied
