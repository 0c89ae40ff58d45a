"""CPU: FP8 values without FP8 dtypes (cupy_flash.fp8): the rounding, the bits and quantize_fp8,
against ml_dtypes' float8_e4m3fn / float8_e5m2 value for value."""

import ml_dtypes
import numpy
import pytest
from helpers import requires_gpu

import cupy_flash
from cupy_flash import fp8

FORMATS = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}


def _codes(fmt):
    codes = numpy.arange(256, dtype=numpy.uint8)
    return codes, codes.view(FORMATS[fmt]).astype(numpy.float64)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_code_decodes_and_encodes_as_ml_dtypes(fmt):
    codes, values = _codes(fmt)
    ours = fp8.decode_fp8(codes, fmt)
    assert ((ours == values) | (numpy.isnan(ours) & numpy.isnan(values))).all()
    finite = numpy.isfinite(values)
    assert (fp8.encode_fp8(values[finite], fmt) == codes[finite]).all()   # -0 keeps its sign bit


@pytest.mark.parametrize("fmt", FORMATS)
def test_rounding_is_ml_dtypes_to_nearest_even_with_saturation(fmt):
    """float32 inputs (what the kernels convert): random magnitudes over the whole range, every value
    and every midpoint between neighbours (the ties, to even); beyond the largest value, saturation
    (the kernels' satfinite), where ml_dtypes' e4m3fn gives NaN."""
    _, values = _codes(fmt)
    positive = numpy.unique(values[numpy.isfinite(values) & (values >= 0)])
    rng = numpy.random.default_rng(0)
    x = numpy.concatenate([rng.standard_normal(50000) * scale for scale in (1e-6, 1e-3, 1, 30, 3e4)]
                          + [positive, (positive[1:] + positive[:-1]) / 2]).astype(numpy.float32)
    x = numpy.concatenate([x, -x])
    inside = numpy.abs(x) <= fp8.FORMATS[fmt].largest
    expected = x[inside].astype(FORMATS[fmt]).astype(numpy.float64)
    ours = fp8.round_fp8(x[inside], fmt)
    assert ((ours == expected) & (numpy.signbit(ours) == numpy.signbit(expected))).all()
    assert (fp8.encode_fp8(x[inside], fmt) == x[inside].astype(FORMATS[fmt]).view(numpy.uint8)).all()
    largest = fp8.FORMATS[fmt].largest
    beyond = numpy.array([largest * 1.2, -1e30, numpy.inf, -numpy.inf, numpy.nan])
    rounded = fp8.round_fp8(beyond, fmt)
    assert list(rounded[:4]) == [largest, -largest, largest, -largest] and numpy.isnan(rounded[4])


@pytest.mark.parametrize("granularity", fp8.GRANULARITIES)
@pytest.mark.parametrize("dtype", [numpy.float16, ml_dtypes.bfloat16, numpy.float32, numpy.float64])
def test_quantize_spans_the_range_and_dequantizes_within_half_a_step(granularity, dtype):
    rng = numpy.random.default_rng(1)
    x = (rng.standard_normal((2, 37, 3, 40)) * numpy.array([1.0, 1e-3, 50.0])[None, None, :, None]).astype(dtype)
    x[1, :, 2] = 0   # an all-zero group: descale 1
    x8, descale = cupy_flash.quantize_fp8(x, granularity=granularity)
    assert x8.dtype == numpy.uint8 and x8.shape == x.shape and descale.dtype == numpy.float32
    exact = x.astype(numpy.float64)
    back = fp8.dequantize_fp8(x8, descale)
    if granularity == "head":
        assert descale.shape == (2, 3) and descale[1, 2] == 1
        amax = numpy.abs(exact).max(axis=(1, 3))
        assert numpy.allclose(descale, numpy.where(amax > 0, amax / 448, 1), rtol=1e-6)
        groups = numpy.where(amax > 0, amax, 1)[:, None, :, None]
    else:
        assert descale.shape == (1, 1)
        groups = numpy.abs(exact).max()
    # each group's largest element lands on 448 (within float32's rounding of the descale)
    assert numpy.abs(fp8.decode_fp8(x8)).max() >= 447
    # half a step of e4m3 (3 mantissa bits) relative to the value, or the subnormals' half quantum
    tolerance = numpy.maximum(numpy.abs(exact) * 2.0**-4, groups / 448 * 2.0**-10) * (1 + 1e-6)
    assert (numpy.abs(back - exact) <= tolerance).all()


def test_hadamard_rotation_is_orthogonal_keeps_scores_and_spreads_an_outlier():
    rng = numpy.random.default_rng(2)
    for d in (8, 40, 64, 96, 128, 256):
        rotation = fp8.hadamard_rotation(d, seed=5)
        assert numpy.abs(rotation @ rotation.T - numpy.eye(d)).max() < 1e-12
        q, k = rng.standard_normal((2, 16, d))
        assert numpy.allclose((q @ rotation) @ (k @ rotation).T, q @ k.T)
    assert not numpy.array_equal(fp8.hadamard_rotation(128, 1), fp8.hadamard_rotation(128, 2))
    spike = numpy.zeros(128)
    spike[7] = 100.0
    assert numpy.abs(spike @ fp8.hadamard_rotation(128)).max() == pytest.approx(100 / numpy.sqrt(128))


def test_quantize_with_a_rotation_rotates_first():
    rng = numpy.random.default_rng(3)
    x = rng.standard_normal((1, 20, 2, 64))
    rotation = fp8.hadamard_rotation(64, seed=9)
    x8, descale = cupy_flash.quantize_fp8(x, rotation=rotation)
    plain8, plain_descale = cupy_flash.quantize_fp8(x @ rotation)
    assert (x8 == plain8).all() and (descale == plain_descale).all()


@pytest.mark.parametrize("call, error, match", [
    (lambda x: cupy_flash.quantize_fp8(x, fmt="e3m4"), ValueError, "fmt"),
    (lambda x: cupy_flash.quantize_fp8(x, granularity="row"), ValueError, "granularity"),
    (lambda x: cupy_flash.quantize_fp8(x[0]), ValueError, "4 dimensions"),
    (lambda x: cupy_flash.quantize_fp8(x.astype(numpy.int32)), TypeError, "dtype"),
    (lambda x: cupy_flash.quantize_fp8(x, rotation=numpy.eye(8)), ValueError, "rotation"),
    (lambda x: cupy_flash.quantize_fp8(numpy.where(x > 1, numpy.inf, x)), ValueError, "inf or NaN"),
    (lambda x: fp8.decode_fp8(x), TypeError, "uint8"),
    (lambda x: fp8.dequantize_fp8(numpy.zeros(x.shape, numpy.uint8), numpy.ones((2, 2))), ValueError, "descale"),
])
def test_bad_arguments_are_named(call, error, match):
    x = numpy.random.default_rng(4).standard_normal((2, 5, 3, 16))
    with pytest.raises(error, match=match):
        call(x)


@requires_gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_cupy_arrays_round_and_quantize_as_numpy_does(fmt):
    """The same arithmetic on CuPy arrays: every code, random float32 values and quantize_fp8 (both
    granularities, a rotation) equal NumPy's results bit for bit."""
    import cupy

    codes, values = _codes(fmt)
    assert numpy.array_equal(cupy.asnumpy(fp8.decode_fp8(cupy.asarray(codes), fmt)), fp8.decode_fp8(codes, fmt),
                             equal_nan=True)
    x = (numpy.random.default_rng(6).standard_normal(100000) * 100).astype(numpy.float32)
    assert (cupy.asnumpy(fp8.encode_fp8(cupy.asarray(x), fmt)) == fp8.encode_fp8(x, fmt)).all()
    batch = numpy.random.default_rng(7).standard_normal((2, 33, 3, 64)).astype(numpy.float32)
    rotation = fp8.hadamard_rotation(64, seed=1)
    for granularity in fp8.GRANULARITIES:
        on_gpu = cupy_flash.quantize_fp8(cupy.asarray(batch), fmt=fmt, granularity=granularity, rotation=rotation)
        on_cpu = cupy_flash.quantize_fp8(batch, fmt=fmt, granularity=granularity, rotation=rotation)
        for a, b in zip(on_gpu, on_cpu):
            assert numpy.array_equal(cupy.asnumpy(a), b)


# ---------------------------------------------------------------------------------------------
# The references on FP8 inputs: the values as dequantised, and the FP8 scheme's rounding.

def _fp8_call(rng, shape_q=(2, 150, 4, 64), heads_kv=2, seqlen_k=170):
    q = rng.standard_normal(shape_q)
    k, v = (rng.standard_normal((shape_q[0], seqlen_k, heads_kv, shape_q[3])) for _ in range(2))
    (q8, qs), (k8, ks), (v8, vs) = (cupy_flash.quantize_fp8(x) for x in (q, k, v))
    return (q8, k8, v8), dict(q_descale=qs, k_descale=ks, v_descale=vs)


def _dequantized(arrays, descales):
    return tuple(fp8.dequantize_fp8(x, descales[f"{n}_descale"]) for n, x in zip("qkv", arrays))


@pytest.mark.parametrize("options", [dict(), dict(causal=True), dict(window_size=(40, 10)),
                                     dict(sink=numpy.linspace(-1, 1, 4))])
def test_fp8_reference_reads_the_dequantised_values_and_rounds_as_the_scheme(options):
    """upcast=True: float64 attention over the dequantised inputs, the accuracy rule's exact. With
    upcast=False and rounding='fp8': P x 2^8 rounded to e4m3 as the P V operand, o in bfloat16;
    the backward in bfloat16 over the rounded dequantised inputs and the FP8 forward's o,
    gradients in bfloat16. Its errors sit where the study (docs/fp8.md) puts them: a few
    percent (o; the gradients through delta), far above bf16's, far below 1."""
    rng = numpy.random.default_rng(8)
    arrays, descales = _fp8_call(rng)
    values = _dequantized(arrays, descales)
    exact = cupy_flash.attention_reference(*arrays, **descales, **options)
    assert all(numpy.array_equal(a, b) for a, b in zip(exact, cupy_flash.attention_reference(*values, **options)))
    o, lse = cupy_flash.attention_reference(*arrays, **descales, upcast=False, rounding="fp8", **options)
    assert o.dtype == numpy.float32 and lse.dtype == numpy.float32
    assert numpy.array_equal(o, o.astype(ml_dtypes.bfloat16).astype(numpy.float32))   # bfloat16 values
    assert numpy.allclose(lse, exact[1], rtol=1e-6)
    error = numpy.sqrt(numpy.mean((o - exact[0]) ** 2) / numpy.mean(exact[0] ** 2))
    assert 2e-3 < error < 6e-2, error
    do = rng.standard_normal(values[0].shape).astype(ml_dtypes.bfloat16)
    exact_grads = cupy_flash.attention_reference_backward(do, *arrays, **descales, **options)
    grads = cupy_flash.attention_reference_backward(do, *arrays, **descales, upcast=False, rounding="fp8", **options)
    assert len(grads) == len(exact_grads) == (4 if "sink" in options else 3)
    for name, ours, want in zip(("dq", "dk", "dv"), grads, exact_grads):
        assert ours.shape == want.shape and numpy.array_equal(ours, ours.astype(ml_dtypes.bfloat16).astype(numpy.float32))
        error = numpy.sqrt(numpy.mean((ours - want) ** 2) / numpy.mean(want ** 2))
        assert 1e-3 < error < 8e-2, (name, error)


def test_fp8_reference_forward_is_the_formula():
    """The forward's FP8 form written out here for one head, from the study's description."""
    rng = numpy.random.default_rng(9)
    arrays, descales = _fp8_call(rng, (1, 40, 1, 16), heads_kv=1, seqlen_k=50)
    q, k, v = (x[0, :, 0] for x in _dequantized(arrays, descales))
    s = q @ k.T / 4.0
    p = numpy.exp(s - s.max(axis=1, keepdims=True))
    operand = fp8.round_fp8(p * 256, "e4m3") / 256
    expected = (operand @ v / p.sum(axis=1, keepdims=True)).astype(numpy.float32).astype(ml_dtypes.bfloat16)
    o, _ = cupy_flash.attention_reference(*arrays, **descales, upcast=False, rounding="fp8")
    assert numpy.array_equal(o[0, :, 0], expected.astype(numpy.float32))


def test_fp8_reference_backward_is_the_formula():
    """The backward's FP8 form (docs/fp8.md, "The backward") written out here for one head."""
    rng = numpy.random.default_rng(11)
    arrays, descales = _fp8_call(rng, (1, 40, 1, 16), heads_kv=1, seqlen_k=50)
    exact = [x[0, :, 0] for x in _dequantized(arrays, descales)]
    q, k, v = (bf16(x) for x in exact)
    s = exact[0] @ exact[1].T / 4.0
    lse = numpy.log(numpy.exp(s - s.max(axis=1, keepdims=True)).sum(axis=1, keepdims=True)) + s.max(axis=1, keepdims=True)
    o, _ = cupy_flash.attention_reference(*arrays, **descales, upcast=False, rounding="fp8")
    do = bf16(rng.standard_normal((1, 40, 1, 16)))
    p = numpy.exp(q @ k.T / 4.0 - lse)   # the rounded operands' scores, the forward's lse
    ds = bf16(p * (do[0, :, 0] @ v.T - (do[0, :, 0] * o[0, :, 0]).sum(axis=1, keepdims=True)))
    expected = [bf16(ds @ k / 4.0), bf16(ds.T @ q / 4.0), bf16(bf16(p).T @ do[0, :, 0])]
    grads = cupy_flash.attention_reference_backward(do.astype(ml_dtypes.bfloat16), *arrays, **descales, upcast=False,
                                                    rounding="fp8")
    for name, ours, want in zip(("dq", "dk", "dv"), grads, expected):
        # the same roundings: equal but where a sum taken in another order lands a value past a tie
        assert numpy.mean(ours[0, :, 0] == want) > 0.95, name
        assert numpy.allclose(ours[0, :, 0], want, rtol=2**-7, atol=1e-6 * abs(want).max()), name


def bf16(x):
    """float64 x rounded to bfloat16 (through float32, as the kernels round), as float64."""
    return numpy.asarray(x, dtype=numpy.float32).astype(ml_dtypes.bfloat16).astype(numpy.float64)


def test_fp8_reference_packed_batch_equals_its_sequences():
    rng = numpy.random.default_rng(10)
    lengths = (30, 1, 57)
    sequences = [_fp8_call(rng, (1, n, 2, 32), heads_kv=1, seqlen_k=n) for n in lengths]
    cu = numpy.concatenate([[0], numpy.cumsum(lengths)]).astype(numpy.int32)
    packed = [numpy.concatenate([s[0][i][0] for s in sequences]) for i in range(3)]
    descales = {name: numpy.concatenate([s[1][name] for s in sequences]) for name in sequences[0][1]}
    o, _ = cupy_flash.attention_reference(*packed, **descales, upcast=False, rounding="fp8", cu_seqlens_q=cu,
                                          cu_seqlens_k=cu, causal=True)
    for (arrays, own), start, n in zip(sequences, cu[:-1], lengths):
        alone, _ = cupy_flash.attention_reference(*arrays, **own, upcast=False, rounding="fp8", causal=True)
        assert numpy.array_equal(o[start:start + n], alone[0])


@pytest.mark.parametrize("change, error, match", [
    (lambda a, d: ((a[0], a[1].astype(numpy.float32), a[2]), d), TypeError, "k has dtype float32 but q is FP8"),
    (lambda a, d: ((a[0].astype(numpy.float32),) + a[1:], d), TypeError, "q has dtype float32 but k is FP8"),
    (lambda a, d: (a, {**d, "v_descale": None}), ValueError, "v_descale is missing"),
    (lambda a, d: (a, {**d, "k_descale": d["k_descale"][:, :1]}), ValueError, "k_descale has shape"),
    (lambda a, d: (a, {**d, "q_descale": numpy.where(d["q_descale"] > 0, numpy.nan, 1)}), ValueError, "q_descale holds"),
    (lambda a, d: (a, {**d, "softcap": 5.0}), ValueError, "softcap is not supported with FP8"),
    (lambda a, d: (a, {**d, "alibi_slopes": numpy.ones(4)}), ValueError, "alibi_slopes is not supported with FP8"),
    (lambda a, d: (a, {**d, "rounding": "dense", "upcast": False}), ValueError, "rounding='fp8'"),
])
def test_fp8_reference_bad_inputs_are_named(change, error, match):
    arrays, descales = change(*_fp8_call(numpy.random.default_rng(11)))
    with pytest.raises(error, match=match):
        cupy_flash.attention_reference(*arrays, **descales)


def test_fp8_rounding_needs_fp8_inputs():
    q = numpy.zeros((1, 4, 1, 8))
    with pytest.raises(ValueError, match="needs q, k, v in FP8"):
        cupy_flash.attention_reference(q, q, q, upcast=False, rounding="fp8")
    with pytest.raises(TypeError, match="q has dtype float64 but q_descale is given"):
        cupy_flash.attention_reference(q, q, q, q_descale=numpy.ones((1, 1)))


@pytest.mark.parametrize("bad, named", [
    ({"k_descale": numpy.inf}, "k_descale"),
    ({"v_descale": 0.0}, "v_descale"),
    ({"v_descale": -1.0, "k_descale": numpy.nan}, "k_descale"),   # the first of q, k, v that fails
    ({"q_descale": numpy.nan, "v_descale": numpy.nan}, "q_descale"),
])
def test_descales_are_read_together_and_the_failing_one_is_named(bad, named):
    """check_fp8_call tests all three descales in one pass (one read-back for GPU ones); where it
    fails, the message names the first descale, in q, k, v order, that holds a bad value."""
    arrays, descales = _fp8_call(numpy.random.default_rng(3))
    for name, value in bad.items():
        descales[name] = descales[name].copy()
        descales[name].flat[-1] = value
    with pytest.raises(ValueError, match=f"{named} holds a value that is not finite and positive"):
        fp8.check_fp8_call("flash_forward", dict(zip("qkv", arrays)), descales, {})
    good = _fp8_call(numpy.random.default_rng(3))[1]
    assert fp8.check_fp8_call("flash_forward", dict(zip("qkv", arrays)), good, {}) is not None
