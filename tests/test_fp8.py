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
