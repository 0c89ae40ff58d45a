"""GPU (Hopper): the FP8 forward and backward against float64 attention over the dequantised inputs,
with the 2x / 3x rule against the reference that rounds as the FP8 scheme does (docs/fp8.md), and
their argument checks. The backward runs on both kernel paths (its products are the bfloat16
backward's).

Inputs are quantised by quantize_fp8 (per (batch, head)), sometimes with 0.1% outliers and the
Hadamard rotation; outputs are NaN-poisoned, and so is V^T's buffer (its padding must be written)."""

import ml_dtypes
import numpy
import pytest
from helpers import (
    KERNEL_PATHS,
    check_error_rule,
    count_example,
    gradient_term_scales,
    jax_on_gpu,
    kernel_path,
    launched_family,
    launched_kernels,
    max_finite_abs,
    packed_gradient_term_scales,
    poisoned_allocations,
    random_array,
    requires_hopper,
    torch_on_gpu,
)
from hypothesis import example, given, settings
from hypothesis import strategies as st

import cupy_flash
from cupy_flash import attention_reference, attention_reference_backward, families, quantize_fp8
from cupy_flash.fp8 import dequantize_fp8, hadamard_rotation

pytestmark = requires_hopper
MAX_SCORES = 12_000_000


@st.composite
def fp8_problems(draw):
    seqlen = st.one_of(st.integers(1, 160), st.integers(160, 700), st.integers(700, 1500))
    seqlen_q, seqlen_k = draw(seqlen), draw(seqlen)
    heads_kv = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 1, 2, 3]))
    batch = draw(st.integers(1, 3))
    while batch * heads_kv * group * seqlen_q * seqlen_k > MAX_SCORES and batch * heads_kv * group > 1:
        batch, heads_kv, group = max(1, batch // 2), max(1, heads_kv - 1), max(1, group - 1)
    features = {}
    if draw(st.booleans()):
        features["window_size"] = (draw(st.integers(-1, 300)), draw(st.integers(-1, 300)))
    if draw(st.integers(0, 3)) == 0:
        features["sink"] = [draw(st.floats(-3, 3)) for _ in range(heads_kv * group)]
    return dict(batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, heads_kv=heads_kv, group=group,
                head_dim=draw(st.sampled_from(range(16, 257, 16))), causal=draw(st.booleans()),
                logit_std=draw(st.sampled_from([0.5, 2.0, 6.0])), outliers=draw(st.booleans()),
                rotate=draw(st.booleans()), q_descale_per_kv_head=draw(st.booleans()), seed=draw(st.integers(0, 2**16)),
                features=features)


def _inputs(p):
    import cupy

    rng = numpy.random.default_rng(p["seed"])
    b, d, heads = p["batch"], p["head_dim"], p["heads_kv"] * p["group"]
    magnitude = (p["logit_std"] * d ** 0.5) ** 0.5 / d ** 0.5   # q.k / sqrt(d) of std ~ logit_std

    def tensor(seqlen, h, scale):
        x = rng.standard_normal((b, seqlen, h, d)) * scale
        if p["outliers"]:   # 0.1% of entries 10-20x larger (FlashAttention-3's outlier study)
            mask = rng.random(x.shape) < 1e-3
            x[mask] *= rng.uniform(10, 20, mask.sum())
        return cupy.asarray(x.astype(numpy.float32))

    rotation = hadamard_rotation(d, p["seed"]) if p["rotate"] else None
    q = tensor(p["seqlen_q"], heads, magnitude)
    if rotation is not None:
        q = q @ cupy.asarray(rotation, dtype=cupy.float32)
    if p["q_descale_per_kv_head"]:   # one descale per K/V head's group of query heads
        grouped = q.reshape(b, p["seqlen_q"], p["heads_kv"], p["group"] * d)
        q8, q_descale = quantize_fp8(grouped)
        q8 = q8.reshape(q.shape)
    else:
        q8, q_descale = quantize_fp8(q)
    k8, k_descale = quantize_fp8(tensor(p["seqlen_k"], p["heads_kv"], magnitude), rotation=rotation)
    v8, v_descale = quantize_fp8(tensor(p["seqlen_k"], p["heads_kv"], 1.0))
    return q8, k8, v8, dict(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)


def _options(p, descales):
    opts = dict(causal=p["causal"], **descales)
    for name, value in p["features"].items():
        opts[name] = cupy_asarray(value) if name == "sink" else value
    return opts


def cupy_asarray(values):
    import cupy

    return cupy.asarray(numpy.asarray(values, dtype=numpy.float32))


def describe(p):
    return " ".join(f"{k}={v}" for k, v in p.items() if k != "features") + f" features={p['features']}"


def check_fp8_forward(p):
    q8, k8, v8, descales = _inputs(p)
    opts = _options(p, descales)
    with poisoned_allocations(), families.recording() as launched:
        o, lse = cupy_flash.flash_forward(q8, k8, v8, **opts)
    assert launched_family(launched) == "forward_sm90_fp8", launched
    assert any(name.startswith("flash_forward_sm90_kernel<fa_e4m3") for name in launched_kernels(launched))
    assert o.shape == q8.shape and o.dtype == numpy.dtype(ml_dtypes.bfloat16)
    assert lse.shape == (q8.shape[0], q8.shape[2], q8.shape[1]) and lse.dtype == numpy.float32
    o_exact, lse_exact = attention_reference(q8, k8, v8, **opts)
    o_fp8, lse_fp8 = attention_reference(q8, k8, v8, upcast=False, rounding="fp8", **opts)
    context = describe(p)
    lse_magnitude = max_finite_abs(lse_exact)
    # The FP8 tensor cores accumulate S = Q K^T with truncation (docs/fp8.md, "accumulation"), which
    # a float64 reference does not: a score may move by FP8_ACCUMULATION per k32 step of the sum of
    # its products' magnitudes, lse by as much, and O by that x 2 max|v|.
    score_error = FP8_ACCUMULATION * -(-p["head_dim"] // 32) * largest_score_magnitude(q8, k8, descales, p["head_dim"])
    v_magnitude = max_finite_abs(dequantize_fp8(v8, descales["v_descale"]))
    check_error_rule("fp8 o", o, o_exact, o_fp8, context, lse_magnitude, 2.0**24 * score_error * 2 * v_magnitude)
    check_error_rule("fp8 lse", lse, lse_exact, lse_fp8, context, lse_magnitude, 2.0**24 * score_error)


# Measured (python -m bench.fp8_accumulation, H100): at most 2^-7.9 of sum |a_c b_c| over 8 k32
# steps (all-positive data: the truncation's bias adds up), 2^-10.8 in one step with outliers.
FP8_ACCUMULATION = 2.0**-10


def largest_score_magnitude(q8, k8, descales, head_dim):
    """max over (b, h, i, j) of softmax_scale x sum_c |q_ic k_jc| on the dequantised inputs."""
    q = abs(dequantize_fp8(q8, _per_head(descales["q_descale"], q8.shape[2])))
    k = abs(dequantize_fp8(k8, descales["k_descale"]))
    group = q.shape[2] // k.shape[2]
    k = k.repeat(group, axis=2) if group > 1 else k
    return float((q.transpose(0, 2, 1, 3) @ k.transpose(0, 2, 3, 1)).max()) / head_dim ** 0.5


def _per_head(descale, heads):
    return descale.repeat(heads // descale.shape[1], axis=1) if descale.shape[1] != heads else descale


BASE = dict(batch=1, seqlen_q=1, seqlen_k=1, heads_kv=1, group=1, head_dim=16, causal=False, logit_std=2.0,
            outliers=False, rotate=False, q_descale_per_kv_head=False, seed=1, features={})


@given(fp8_problems())
@settings(deadline=None)
@example(BASE)
@example(dict(BASE, seqlen_q=300, seqlen_k=1000, heads_kv=2, group=3, head_dim=256, causal=True, seed=2))
@example(dict(BASE, batch=2, seqlen_q=129, seqlen_k=257, head_dim=128, outliers=True, rotate=True, seed=3,
              features={"window_size": (100, 20), "sink": [0.5]}))
@example(dict(BASE, seqlen_q=500, seqlen_k=33, head_dim=64, causal=True, logit_std=6.0, seed=4))
def test_fp8_forward_matches_reference(p):
    count_example("fp8_forward_matches_reference")
    check_fp8_forward(p)


def check_fp8_backward(context, path, q8, k8, v8, opts, o, lse, do, score_error, term_scales):
    """flash_backward on the FP8 forward's o and lse on kernel path ``path``: dq, dk, dv (and dsink)
    in bfloat16 against float64 over the dequantised inputs, 3x the FP8 reference's error. The
    floors: the forward's lse off by score_error (its truncated accumulation: every P moves by that
    factor) and delta from the kernel's o, not the reference's (gradient_term_scales' delta terms)."""
    with poisoned_allocations(), kernel_path(path), families.recording() as launched:
        grads = cupy_flash.flash_backward(do, q8, k8, v8, o, lse, **opts)
    kernels = launched_kernels(launched)
    assert kernels[:3] == ["fp8_dequantize_kernel<fa_bf16>"] * 3, kernels
    assert launched[1][0] == ("backward_sm90" if path == "hopper" else "backward_tc"), launched
    exact = attention_reference_backward(do, q8, k8, v8, **opts)
    low = attention_reference_backward(do, q8, k8, v8, upcast=False, rounding="fp8", **opts)
    assert len(grads) == len(exact) == len(low)
    context += f" kernels={path}"
    for name, ours, x, e, lo in zip(("dq", "dk", "dv", "dsink"), grads, (q8, k8, v8, None), exact, low):
        if x is not None:
            assert ours.shape == x.shape and ours.dtype == numpy.dtype(ml_dtypes.bfloat16), (name, ours.dtype)
        term = float(abs(e).max()) * q8.shape[0] * q8.shape[1] if name == "dsink" else term_scales.get(name, 0.0)
        check_error_rule(f"fp8 {name}", ours, e, lo, context, 0.0, 2.0**24 * 2 * score_error * term,
                         term_scales.get("delta:" + name, 0.0), factor=3.0)


def dequantised_arrays(q8, k8, v8, descales):
    """q, k, v as float32 values (the inputs the gradients are of), for gradient_term_scales."""
    import cupy

    return tuple(cupy.asarray(dequantize_fp8(x, _per_head(descales[f"{n}_descale"], x.shape[-2])), dtype=cupy.float32)
                 for n, x in zip("qkv", (q8, k8, v8)))


@pytest.mark.parametrize("path", KERNEL_PATHS)
@given(fp8_problems())
@settings(deadline=None, max_examples=40)
@example(BASE)
@example(dict(BASE, seqlen_q=300, seqlen_k=1000, heads_kv=2, group=3, head_dim=256, causal=True, seed=2))
@example(dict(BASE, batch=2, seqlen_q=129, seqlen_k=257, head_dim=128, outliers=True, rotate=True, seed=3,
              features={"window_size": (100, 20), "sink": [0.5]}))
@example(dict(BASE, seqlen_q=500, seqlen_k=33, head_dim=64, causal=True, logit_std=6.0, q_descale_per_kv_head=True,
              seed=4))
def test_fp8_backward_matches_reference(path, p):
    count_example("fp8_backward_matches_reference")
    q8, k8, v8, descales = _inputs(p)
    opts = _options(p, descales)
    o, lse = cupy_flash.flash_forward(q8, k8, v8, **opts)
    score_error = FP8_ACCUMULATION * -(-p["head_dim"] // 32) * largest_score_magnitude(q8, k8, descales, p["head_dim"])
    rng = numpy.random.default_rng(p["seed"] + 1)
    do = random_array(rng, q8.shape, "bfloat16")
    features = {n: x for n, x in opts.items() if not n.endswith("_descale")}
    term_scales = gradient_term_scales(do, *dequantised_arrays(q8, k8, v8, descales), o=o, **features)
    check_fp8_backward(describe(p), path, q8, k8, v8, opts, o, lse, do, score_error, term_scales)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_quantize_fp8_on_the_gpu_gives_the_array_arithmetics_bits(dtype, monkeypatch):
    """quantize_fp8's kernels (CuPy, e4m3, per head, no rotation) against its NumPy float64 path:
    bits and descales equal, on strided views, all-zero groups, negative zeros, ties of e4m3's grid
    (normal and subnormal, in a group whose descale is 1), values past its subnormals and a wide
    range; inf or NaN refused; a rotation keeps the array path."""
    import cupy

    from cupy_flash.families import rows

    calls = []
    quantize_e4m3 = rows.quantize_e4m3
    monkeypatch.setattr(rows, "quantize_e4m3", lambda x: calls.append(x.shape) or quantize_e4m3(x))
    rng = numpy.random.default_rng(7)
    for seqlen, heads, head_dim in ((1, 1, 16), (37, 3, 64), (300, 2, 128), (65, 5, 256)):
        x = rng.standard_normal((2, seqlen, heads, head_dim)) * numpy.exp(rng.uniform(-8, 8, (2, 1, heads, 1)))
        x[0, :, 0] = numpy.clip(x[0, :, 0], -1, 1)   # a group whose amax is 448: descale 1, x's own grid
        x[0, 0, 0, :8] = [448.0, -0.0, 3.125, -4.75, 1.5 * 2.0**-9, 2.0**-10, -2.5 * 2.0**-9, 1e-30]   # ties, -0, tiny
        if heads > 1:
            x[1, :, -1] = 0.0   # an all-zero group: descale 1
        wide = numpy.concatenate([x, x[:, :, :1]], axis=2)   # a view with a head stride of its own
        for strided in (False, True):
            host = x.astype(DTYPES_BY_NAME[dtype])
            device = cupy.asarray(wide.astype(DTYPES_BY_NAME[dtype]))[:, :, :heads] if strided else cupy.asarray(host)
            before = len(calls)
            bits, descale = quantize_fp8(device)
            assert len(calls) == before + 1   # the kernels ran
            expected_bits, expected_descale = quantize_fp8(host)
            context = (dtype, seqlen, heads, head_dim, strided)
            assert bool((cupy.asnumpy(bits) == expected_bits).all()), context
            assert bool((cupy.asnumpy(descale) == expected_descale).all()), context
    bad = cupy.zeros((1, 4, 1, 16), dtype=cupy.float32)
    bad[0, 2, 0, 3] = float("nan")
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_fp8(bad)
    before = len(calls)
    rotated = quantize_fp8(cupy.asarray(x[..., :64].astype(numpy.float32)), rotation=hadamard_rotation(64, 1))
    expected = quantize_fp8(x[..., :64].astype(numpy.float32), rotation=hadamard_rotation(64, 1))
    assert len(calls) == before and bool((cupy.asnumpy(rotated[0]) == expected[0]).all())


DTYPES_BY_NAME = {"float16": numpy.float16, "bfloat16": ml_dtypes.bfloat16, "float32": numpy.float32}


def _bad_calls():
    """(label, change to a good call's keywords, the error type, words its message must hold)."""
    import cupy

    nan = cupy.asarray([[float("nan")]], dtype=cupy.float32)
    return [
        ("bf16 v", dict(v="bf16"), TypeError, "v has dtype"),
        ("missing k_descale", dict(k_descale=None), ValueError, "k_descale is missing"),
        ("non-finite v_descale", dict(v_descale=nan), ValueError, "v_descale holds a value"),
        ("zero q_descale", dict(q_descale=cupy.zeros((1, 1), cupy.float32)), ValueError, "q_descale holds a value"),
        ("misshapen k_descale", dict(k_descale=cupy.ones((2, 1), cupy.float32)), ValueError, "k_descale has shape"),
        ("integer v_descale", dict(v_descale=cupy.ones((1, 1), cupy.int32)), TypeError, "v_descale has dtype"),
        ("softcap", dict(softcap=2.0), ValueError, "softcap is not supported with FP8"),
        ("alibi", dict(alibi_slopes=[0.5]), ValueError, "alibi_slopes is not supported with FP8"),
        ("num_splits", dict(num_splits=2), ValueError, "num_splits"),
        ("typo", dict(casual=True), TypeError, "casual"),
    ]


@pytest.mark.parametrize("case", range(10))
def test_fp8_bad_input_raises_before_any_launch(case):
    import cupy

    label, change, error, words = _bad_calls()[case]
    q8, k8, v8, descales = _inputs(dict(BASE, seqlen_q=5, seqlen_k=7, head_dim=32))
    call = dict(q=q8, k=k8, v=v8, **descales)
    for name, value in change.items():
        call[name] = cupy.zeros(v8.shape, dtype=cupy.float32).astype(ml_dtypes.bfloat16) if isinstance(value, str) else value
    call = {name: value for name, value in call.items() if value is not None}
    with families.recording() as launched, pytest.raises(error) as raised:
        cupy_flash.flash_forward(call.pop("q"), call.pop("k"), call.pop("v"), **call)
    assert words in str(raised.value), (label, str(raised.value))
    assert launched == [], label


def _bad_backward_calls():
    """(label, change to a good backward call's keywords, the error type, words its message must hold)."""
    import cupy

    return [
        ("fp16 do", dict(do="float16"), TypeError, "do has dtype"),
        ("float32 o", dict(o="float32"), TypeError, "o has dtype"),
        ("bf16 k", dict(k="bfloat16"), TypeError, "k has dtype"),
        ("missing v_descale", dict(v_descale=None), ValueError, "v_descale is missing"),
        ("misshapen q_descale", dict(q_descale=cupy.ones((3, 1), cupy.float32)), ValueError, "q_descale has shape"),
        ("softcap", dict(softcap=1.5), ValueError, "softcap is not supported with FP8"),
        ("return_dbias", dict(return_dbias=True), ValueError, "return_dbias"),
        ("short lse", dict(lse="short"), ValueError, "lse has shape"),
        ("typo", dict(window=(4, 4)), TypeError, "window"),
    ]


@pytest.mark.parametrize("case", range(9))
def test_fp8_backward_bad_input_raises_before_any_launch(case):
    import cupy

    label, change, error, words = _bad_backward_calls()[case]
    q8, k8, v8, descales = _inputs(dict(BASE, seqlen_q=5, seqlen_k=7, head_dim=32))
    o, lse = cupy_flash.flash_forward(q8, k8, v8, **descales)
    call = dict(do=o.copy(), q=q8, k=k8, v=v8, o=o, lse=lse, **descales)
    for name, value in change.items():
        if isinstance(value, str) and value == "short":
            value = lse[:, :, :-1]
        elif isinstance(value, str):
            value = cupy.zeros(call[name].shape, dtype=cupy.float32).astype(
                ml_dtypes.bfloat16 if value == "bfloat16" else value)
        call[name] = value
    call = {name: value for name, value in call.items() if value is not None}
    arrays = [call.pop(name) for name in ("do", "q", "k", "v", "o", "lse")]
    with families.recording() as launched, pytest.raises(error) as raised:
        cupy_flash.flash_backward(*arrays, **call)
    assert words in str(raised.value), (label, str(raised.value))
    assert launched == [], label


@pytest.mark.parametrize("head_dim", [8, 24, 272])
def test_fp8_head_dims_off_sixteen_raise(head_dim):
    import cupy

    q8 = cupy.zeros((1, 4, 1, head_dim), dtype=cupy.uint8)
    one = cupy.ones((1, 1), dtype=cupy.float32)
    with pytest.raises(ValueError, match="head_dim"):
        cupy_flash.flash_forward(q8, q8, q8, q_descale=one, k_descale=one, v_descale=one)


def test_fp8_inputs_are_not_modified_and_calls_repeat_bitwise():
    q8, k8, v8, descales = _inputs(dict(BASE, batch=2, seqlen_q=300, seqlen_k=400, heads_kv=2, group=2, head_dim=128,
                                        causal=True))
    before = [x.copy() for x in (q8, k8, v8, *descales.values())]
    first = cupy_flash.flash_forward(q8, k8, v8, causal=True, **descales)
    second = cupy_flash.flash_forward(q8, k8, v8, causal=True, **descales)
    for x, y in zip(before, (q8, k8, v8, *descales.values())):
        assert bool((x == y).all())
    for x, y in zip(first, second):
        assert bool((x.view(numpy.uint8) == y.view(numpy.uint8)).all())


def test_fp8_repeated_calls_take_their_plan_and_check_the_descales_each_time():
    import cupy

    from cupy_flash import forward_fp8

    q8, k8, v8, descales = _inputs(dict(BASE, batch=2, seqlen_q=200, seqlen_k=300, heads_kv=2, group=2, head_dim=64))
    forward_fp8._plans.clear()
    first, _ = cupy_flash.flash_forward(q8, k8, v8, causal=True, **descales)
    assert len(forward_fp8._plans) == 1
    doubled = dict(descales, v_descale=descales["v_descale"] * 2)
    with poisoned_allocations():
        second, _ = cupy_flash.flash_forward(q8, k8, v8, causal=True, **doubled)
    assert len(forward_fp8._plans) == 1
    assert bool((as_float(second) == 2 * as_float(first)).all())   # O scales by v_descale exactly
    host = {name: cupy.asnumpy(x) for name, x in descales.items()}
    third, _ = cupy_flash.flash_forward(q8, k8, v8, causal=True, **host)   # host descales: a plan of their own
    assert bool((third.view(numpy.uint16) == first.view(numpy.uint16)).all())
    bad = dict(descales, k_descale=cupy.full_like(descales["k_descale"], float("inf")))
    with families.recording() as launched, pytest.raises(ValueError, match="k_descale holds a value"):
        cupy_flash.flash_forward(q8, k8, v8, causal=True, **bad)
    assert launched == []
    # host descales on the short path: a value to refuse sends the call to the checks, which name it
    for name, value in (("q_descale", float("nan")), ("v_descale", 0.0), ("k_descale", 1e300)):
        bad = dict(host, **{name: numpy.full_like(host[name], value, dtype=numpy.float64)})
        cupy_flash.flash_forward(q8, k8, v8, causal=True, **dict(host, **{name: host[name].astype(numpy.float64)}))
        with families.recording() as launched, pytest.raises(ValueError, match=f"{name} holds a value"):
            cupy_flash.flash_forward(q8, k8, v8, causal=True, **bad)
        assert launched == [], name


def test_fp8_backward_repeated_calls_take_their_plan():
    """A repeated FP8 backward with host descales takes its short path (backward_fp8's plan): the
    checked route's gradients bitwise, new descale values included; a value to refuse still raises
    before any launch; GPU descales take the checked route. (deterministic: bitwise comparable.)"""
    import cupy

    from cupy_flash import backward_fp8

    q8, k8, v8, descales = _inputs(dict(BASE, batch=2, seqlen_q=200, seqlen_k=300, heads_kv=2, group=2, head_dim=64))
    host = {name: cupy.asnumpy(x) for name, x in descales.items()}
    o, lse = cupy_flash.flash_forward(q8, k8, v8, causal=True, **host)
    do = random_array(numpy.random.default_rng(5), q8.shape, "bfloat16")
    backward_fp8._plans.clear()
    checked = cupy_flash.flash_backward(do, q8, k8, v8, o, lse, causal=True, deterministic=True, **host)
    assert len(backward_fp8._plans) == 1
    doubled = dict(host, q_descale=host["q_descale"] * 2)
    for descale_set in (host, doubled):
        backward_fp8._plans.clear()
        expected = cupy_flash.flash_backward(do, q8, k8, v8, o, lse, causal=True, deterministic=True, **descale_set)
        with poisoned_allocations(), families.recording() as launched:
            short = cupy_flash.flash_backward(do, q8, k8, v8, o, lse, causal=True, deterministic=True, **descale_set)
        assert launched_kernels(launched)[:3] == ["fp8_dequantize_kernel<fa_bf16>"] * 3
        for x, y in zip(expected, short):
            assert bool((x.view(numpy.uint16) == y.view(numpy.uint16)).all())
    assert not bool((short[0].view(numpy.uint16) == checked[0].view(numpy.uint16)).all())   # dq moved with q_descale
    bad = dict(host, k_descale=numpy.full_like(host["k_descale"], float("nan")))
    with families.recording() as launched, pytest.raises(ValueError, match="k_descale holds a value"):
        cupy_flash.flash_backward(do, q8, k8, v8, o, lse, causal=True, deterministic=True, **bad)
    assert launched == []
    gpu = cupy_flash.flash_backward(do, q8, k8, v8, o, lse, causal=True, deterministic=True, **descales)
    for x, y in zip(checked, gpu):
        assert bool((x.view(numpy.uint16) == y.view(numpy.uint16)).all())


def test_fp8_calls_captured_in_a_cuda_graph_replay_the_eager_results():
    """The FP8 forward and backward with GPU descales captured in a CUDA graph (the descales' values
    are not read back there) replay the eager calls' bits; host descales are refused in a capture."""
    import cupy

    q8, k8, v8, descales = _inputs(dict(BASE, batch=2, seqlen_q=200, seqlen_k=300, heads_kv=2, group=2, head_dim=128))
    do = random_array(numpy.random.default_rng(6), q8.shape, "bfloat16")

    def calls():
        o, lse = cupy_flash.flash_forward(q8, k8, v8, causal=True, **descales)
        return (o, lse) + cupy_flash.flash_backward(do, q8, k8, v8, o, lse, causal=True, deterministic=True, **descales)

    eager = calls()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        calls()
        stream.begin_capture()
        captured = calls()
        graph = stream.end_capture()
        graph.launch()
        stream.synchronize()
        host = {name: cupy.asnumpy(x) for name, x in descales.items()}
        stream.begin_capture()
        try:
            with pytest.raises(ValueError, match="q_descale is a host array, but the stream is capturing"):
                cupy_flash.flash_forward(q8, k8, v8, causal=True, **host)
        finally:
            stream.end_capture()
    for x, y in zip(eager, captured):
        assert bool((x.view(numpy.uint8) == y.view(numpy.uint8)).all())


def test_fp8_trusted_gpu_descales_are_not_read_back():
    """Inside fp8.trusted_descales, GPU descales are not read back: forward and backward calls
    queued behind long GPU work return before it ends (their short paths), with the checked
    calls' bits; a NaN descale is not refused there and gives NaN."""
    import cupy

    from cupy_flash.fp8 import trusted_descales

    q8, k8, v8, descales = _inputs(dict(BASE, batch=2, seqlen_q=200, seqlen_k=300, heads_kv=2, group=2, head_dim=64))
    assert descales["q_descale"].shape == (2, 4)   # per query head, float32: the short path takes them as they are
    do = random_array(numpy.random.default_rng(8), q8.shape, "bfloat16")
    o_checked, lse_checked = cupy_flash.flash_forward(q8, k8, v8, causal=True, **descales)
    grads_checked = cupy_flash.flash_backward(do, q8, k8, v8, o_checked, lse_checked, causal=True, deterministic=True,
                                              **descales)
    with trusted_descales():
        o, lse = cupy_flash.flash_forward(q8, k8, v8, causal=True, **descales)   # plans kept
        cupy_flash.flash_backward(do, q8, k8, v8, o, lse, causal=True, deterministic=True, **descales)
        cupy.cuda.Device().synchronize()
        matmuls_done = queued_gpu_work()
        o, lse = cupy_flash.flash_forward(q8, k8, v8, causal=True, **descales)
        grads = cupy_flash.flash_backward(do, q8, k8, v8, o, lse, causal=True, deterministic=True, **descales)
        assert not matmuls_done.done   # neither call waited for the queued work
        nan = dict(descales, v_descale=cupy.full_like(descales["v_descale"], float("nan")))
        o_nan, _ = cupy_flash.flash_forward(q8, k8, v8, causal=True, **nan)
    cupy.cuda.Device().synchronize()
    for x, y in zip((o_checked, lse_checked, *grads_checked), (o, lse, *grads)):
        assert bool((x.view(numpy.uint8) == y.view(numpy.uint8)).all())
    assert bool(cupy.isnan(as_float(o_nan)).all())


def test_fp8_short_paths_alternating_streams_and_descales_keep_their_bits():
    """The short paths' caches (plans, packed launches, the DescaleRing's slots) on two streams in
    turn, one of them queued behind long GPU work, with two descale sets in turn, for more calls
    than the ring has slots: each call gives the checked route's bits for its own descales."""
    import cupy

    from cupy_flash import backward_fp8, forward_fp8

    q8, k8, v8, descales = _inputs(dict(BASE, batch=2, seqlen_q=150, seqlen_k=170, heads_kv=2, group=2, head_dim=64))
    do = random_array(numpy.random.default_rng(9), q8.shape, "bfloat16")
    host = {name: cupy.asnumpy(x) for name, x in descales.items()}
    sets = [host, dict(host, v_descale=host["v_descale"] * 2, q_descale=host["q_descale"] * 0.5)]

    def call(scales):
        o, lse = cupy_flash.flash_forward(q8, k8, v8, causal=True, **scales)
        return (o, lse) + cupy_flash.flash_backward(do, q8, k8, v8, o, lse, causal=True, deterministic=True, **scales)

    expected = []
    for scales in sets:   # the checked route
        forward_fp8._plans.clear()
        backward_fp8._plans.clear()
        expected.append(call(scales))
    call(sets[0])   # plans kept
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
    results = []
    for i in range(2 * forward_fp8.DescaleRing.SLOTS + 3):
        with streams[i % 2]:
            if i == 0:
                queued_gpu_work()   # stream 0's calls queue behind it
            results.append((i % 2, call(sets[i % 2])))
    cupy.cuda.Device().synchronize()
    for which, outputs in results:
        for x, y in zip(expected[which], outputs):
            assert bool((x.view(numpy.uint8) == y.view(numpy.uint8)).all()), which


def queued_gpu_work():
    """An event recorded after ~tens of ms of matrix products queued on the current stream: the
    launches after it wait behind them."""
    import cupy

    big = cupy.ones((4096, 4096), dtype=cupy.float32)
    for _ in range(6):
        big = big @ big * (1 / 4096)
    done = cupy.cuda.Event()
    done.record()
    return done


def as_float(o):
    import cupy

    return (o.view(cupy.uint16).astype(cupy.uint32) << 16).view(cupy.float32)


def test_fp8_host_descales_go_up_without_waiting_and_buffers_are_reused_only_when_done():
    """Host descales reach the kernels through pinned buffers: a call queued behind long GPU work
    returns before that work ends, and its result equals the GPU descales' bitwise, for more calls
    in flight than DescaleRing keeps slots."""
    import cupy

    from cupy_flash import forward_fp8

    q8, k8, v8, descales = _inputs(dict(BASE, batch=1, seqlen_q=100, seqlen_k=120, heads_kv=2, group=2, head_dim=64))
    expected, _ = cupy_flash.flash_forward(q8, k8, v8, **descales)
    host = {name: cupy.asnumpy(x) for name, x in descales.items()}
    cupy_flash.flash_forward(q8, k8, v8, **host)   # the plan and a first buffer
    cupy.cuda.Device().synchronize()
    matmuls_done = queued_gpu_work()
    results = []
    for i in range(forward_fp8.DescaleRing.SLOTS + 8):
        factor = 2 ** (i % 3)   # O scales by it exactly
        results.append((factor, cupy_flash.flash_forward(q8, k8, v8, **dict(host, v_descale=host["v_descale"] * factor))[0]))
        if i == 0:
            assert not matmuls_done.done   # the call returned while the queued work still ran
    cupy.cuda.Device().synchronize()
    for factor, o in results:
        assert bool((as_float(o) == factor * as_float(expected)).all())


@st.composite
def fp8_packed_problems(draw):
    batch = draw(st.integers(1, 4))
    lengths = st.one_of(st.integers(0, 3), st.integers(1, 300), st.integers(300, 700))
    lens_q, lens_k = [draw(lengths) for _ in range(batch)], [draw(lengths) for _ in range(batch)]
    # Packed batches hold a token at least (flash_forward refuses empty tensors), as in test_attention_gpu.
    lens_q[0], lens_k[0] = max(lens_q[0], int(sum(lens_q) == 0)), max(lens_k[0], int(sum(lens_k) == 0))
    return dict(lens_q=lens_q, lens_k=lens_k,
                heads_kv=draw(st.integers(1, 2)), group=draw(st.sampled_from([1, 2])),
                head_dim=draw(st.sampled_from([16, 64, 128, 176, 256])), causal=draw(st.booleans()),
                window=draw(st.sampled_from([None, (50, 10), (-1, 0)])), sink=draw(st.booleans()),
                seed=draw(st.integers(0, 2**16)))


def _packed_inputs(p):
    """q, k, v packed (total, heads, d) as uint8 e4m3 bits, each sequence quantised on its own
    (descales (batch, heads); 1 for an empty sequence), and cu_seqlens."""
    import cupy

    rng = numpy.random.default_rng(p["seed"])
    d, heads = p["head_dim"], p["heads_kv"] * p["group"]
    magnitude = (2.0 * d ** 0.5) ** 0.5 / d ** 0.5

    def packed(lengths, h, scale):
        bits, descales = [], []
        for n in lengths:
            if n == 0:
                bits.append(cupy.zeros((0, h, d), dtype=cupy.uint8))
                descales.append(cupy.ones((1, h), dtype=cupy.float32))
                continue
            x8, descale = quantize_fp8(cupy.asarray((rng.standard_normal((1, n, h, d)) * scale).astype(numpy.float32)))
            bits.append(x8[0])
            descales.append(descale)
        return cupy.concatenate(bits), cupy.concatenate(descales)

    q8, q_descale = packed(p["lens_q"], heads, magnitude)
    k8, k_descale = packed(p["lens_k"], p["heads_kv"], magnitude)
    v8, v_descale = packed(p["lens_k"], p["heads_kv"], 1.0)
    cu = [cupy.asarray(numpy.concatenate([[0], numpy.cumsum(n)]).astype(numpy.int32)) for n in (p["lens_q"], p["lens_k"])]
    return q8, k8, v8, dict(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale), cu


@pytest.mark.parametrize("path", KERNEL_PATHS)
@given(fp8_packed_problems())
@settings(deadline=None, max_examples=25)
@example(dict(lens_q=[70, 0, 200], lens_k=[45, 9, 130], heads_kv=2, group=2, head_dim=128, causal=True, window=None,
              sink=True, seed=1))
@example(dict(lens_q=[1, 33], lens_k=[0, 65], heads_kv=1, group=1, head_dim=256, causal=False, window=(50, 10),
              sink=False, seed=2))
def test_fp8_packed_batches_match_reference(path, p):
    import cupy

    count_example("fp8_packed_batches_match_reference")
    q8, k8, v8, descales, (cu_q, cu_k) = _packed_inputs(p)
    opts = dict(causal=p["causal"], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **descales)
    if p["window"] is not None:
        opts["window_size"] = p["window"]
    if p["sink"]:
        opts["sink"] = cupy.linspace(-1, 1, q8.shape[1], dtype=cupy.float32)
    with poisoned_allocations(), families.recording() as launched:
        o, lse = cupy_flash.flash_forward(q8, k8, v8, **opts)
    assert launched_family(launched) == "forward_sm90_fp8", launched
    assert o.shape == q8.shape and lse.shape == (q8.shape[1], q8.shape[0])
    o_exact, lse_exact = attention_reference(q8, k8, v8, **opts)
    o_fp8, lse_fp8 = attention_reference(q8, k8, v8, upcast=False, rounding="fp8", **opts)
    context = " ".join(f"{k}={v}" for k, v in p.items())
    lse_magnitude = max_finite_abs(lse_exact)
    bounds_q, bounds_k = numpy.cumsum([0] + p["lens_q"]), numpy.cumsum([0] + p["lens_k"])
    magnitude = max([largest_score_magnitude(q8[None, bounds_q[b]:bounds_q[b + 1]], k8[None, bounds_k[b]:bounds_k[b + 1]],
                                             {name: x[b:b + 1] for name, x in descales.items()}, p["head_dim"])
                     for b in range(len(p["lens_q"])) if p["lens_q"][b] and p["lens_k"][b]] or [0.0])
    score_error = FP8_ACCUMULATION * -(-p["head_dim"] // 32) * magnitude
    v_magnitude = max_finite_abs(cupy.concatenate([dequantize_fp8(v8[None, bounds_k[b]:bounds_k[b + 1]], descales["v_descale"][b:b + 1])
                                                   .ravel() for b in range(len(p["lens_k"]))]))
    check_error_rule("fp8 packed o", o, o_exact, o_fp8, context, lse_magnitude, 2.0**24 * score_error * 2 * v_magnitude)
    check_error_rule("fp8 packed lse", lse, lse_exact, lse_fp8, context, lse_magnitude, 2.0**24 * score_error)
    do = random_array(numpy.random.default_rng(p["seed"] + 1), q8.shape, "bfloat16")
    values = [packed_dequantised(x, descales[f"{n}_descale"], lengths)
              for n, x, lengths in zip("qkv", (q8, k8, v8), (p["lens_q"], p["lens_k"], p["lens_k"]))]
    features = {n: x for n, x in opts.items() if not n.endswith("_descale")}
    term_scales = packed_gradient_term_scales(len(p["lens_q"]), do, *values, o, features)
    check_fp8_backward(context, path, q8, k8, v8, opts, o, lse, do, score_error, term_scales)


def packed_dequantised(x8, descale, lengths):
    """A packed FP8 array's float32 values: each token times its sequence's (and head's) descale."""
    import cupy

    from cupy_flash.fp8 import decode_fp8

    per_token = _per_head(numpy.repeat(cupy.asnumpy(descale), lengths, axis=0), x8.shape[1])
    return cupy.asarray(decode_fp8(x8) * cupy.asarray(per_token)[:, :, None], dtype=cupy.float32)


def _expected_for_frameworks():
    q8, k8, v8, descales = _inputs(dict(BASE, batch=2, seqlen_q=150, seqlen_k=170, heads_kv=2, group=2, head_dim=64))
    return (q8, k8, v8), descales, cupy_flash.flash_forward(q8, k8, v8, causal=True, **descales)


def test_fp8_takes_pytorch_e4m3_tensors():
    """torch.float8_e4m3fn tensors (taken as uint8 bits through DLPack, no copy) give the uint8
    call's result bitwise."""
    torch = torch_on_gpu()
    inputs, descales, (expected, expected_lse) = _expected_for_frameworks()
    as_torch = [torch.from_dlpack(x).view(torch.float8_e4m3fn) for x in inputs]
    o, lse = cupy_flash.flash_forward(*as_torch, causal=True, **{n: torch.from_dlpack(x) for n, x in descales.items()})
    assert bool((o.view(numpy.uint16) == expected.view(numpy.uint16)).all()) and bool((lse == expected_lse).all())


def test_fp8_takes_jax_e4m3_arrays():
    """jnp.float8_e4m3fn arrays (bitcast to uint8, then DLPack) give the uint8 call's result bitwise."""
    jax = jax_on_gpu()
    inputs, descales, (expected, expected_lse) = _expected_for_frameworks()
    as_jax = [jax.lax.bitcast_convert_type(jax.dlpack.from_dlpack(x), jax.numpy.float8_e4m3fn) for x in inputs]
    o, lse = cupy_flash.flash_forward(*as_jax, causal=True, **descales)
    assert bool((o.view(numpy.uint16) == expected.view(numpy.uint16)).all()) and bool((lse == expected_lse).all())


def test_fp8_jax_adapter_under_jit_takes_e4m3_arrays_with_descales():
    """jax_adapter.flash_forward on jnp.float8_e4m3fn arrays with descales as JAX arrays, under
    jax.jit: the CuPy call's o and lse bitwise; a missing descale or a bf16 k is refused while
    tracing."""
    import cupy

    jax = jax_on_gpu()
    jnp = jax.numpy
    from cupy_flash.jax_adapter import flash_forward as jax_forward

    inputs, descales, (expected, expected_lse) = _expected_for_frameworks()
    q, k, v = (jax.lax.bitcast_convert_type(jax.dlpack.from_dlpack(x), jnp.float8_e4m3fn) for x in inputs)
    scales = [jax.dlpack.from_dlpack(descales[f"{name}_descale"]) for name in "qkv"]

    @jax.jit
    def attention(q, k, v, q_descale, k_descale, v_descale):
        return jax_forward(q, k, v, causal=True, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)

    o, lse = attention(q, k, v, *scales)
    assert o.dtype == jnp.bfloat16
    bits = cupy.from_dlpack(jax.lax.bitcast_convert_type(o, jnp.uint16))
    assert bool((bits == expected.view(numpy.uint16)).all())
    assert bool((cupy.from_dlpack(lse) == expected_lse).all())
    with pytest.raises(ValueError, match="v_descale is missing"):
        jax.jit(lambda q, k, v, a, b: jax_forward(q, k, v, q_descale=a, k_descale=b))(q, k, v, *scales[:2])
    with pytest.raises(TypeError, match="k has dtype"):
        jax.jit(lambda q, k, v: jax_forward(q, k, v, q_descale=scales[0], k_descale=scales[1], v_descale=scales[2]))(
            q, k.astype(jnp.bfloat16), v)


def test_fp8_through_the_pytorch_adapter():
    """flash_attn_func on torch.float8_e4m3fn tensors with FlashAttention-3's descale keywords: the
    direct call's O bitwise, on PyTorch's current stream; a gradient or torch.compile is refused."""
    torch = torch_on_gpu()
    from cupy_flash.torch_adapter import flash_attn_func

    inputs, descales, (expected, _) = _expected_for_frameworks()
    q, k, v = (torch.from_dlpack(x).view(torch.float8_e4m3fn) for x in inputs)
    torch_descales = {name: torch.from_dlpack(x) for name, x in descales.items()}
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        o = flash_attn_func(q, k, v, causal=True, **torch_descales)
    side.synchronize()
    assert o.dtype == torch.bfloat16 and o.shape == q.shape
    assert bool((o.view(torch.int16) == torch.from_dlpack(expected.view(numpy.int16))).all())
    wanting = torch.from_dlpack(inputs[0].astype(numpy.float32)).requires_grad_()
    with pytest.raises(NotImplementedError, match="FP8 inputs take no gradient here"):
        flash_attn_func(q, k, wanting, causal=True, **torch_descales)


def test_fp8_attention_with_gradients_through_the_pytorch_adapter():
    """flash_attn_fp8_func on bf16 tensors that require grad: O and dq, dk, dv bitwise those of the
    CuPy route (quantize_fp8, the FP8 flash_forward, the FP8 flash_backward), eager and under
    torch.compile(fullgraph=True); float16 inputs get float16 O and gradients."""
    import cupy

    torch = torch_on_gpu()
    from cupy_flash.torch_adapter import flash_attn_fp8_func

    generator = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(2, n, h, 64, device="cuda", generator=generator).to(torch.bfloat16)
               for n, h in ((150, 4), (170, 2), (170, 2)))
    weight = torch.randn(2, 150, 4, 64, device="cuda", generator=generator).to(torch.bfloat16)

    def loss_and_grads(function, inputs):
        leaves = [x.detach().clone().requires_grad_() for x in inputs]
        o = function(*leaves)
        (o.float() * weight.float()).sum().backward()
        return [o.detach()] + [x.grad for x in leaves]

    def attention(q, k, v):
        return flash_attn_fp8_func(q, k, v, causal=True, deterministic=True)

    quantised = [quantize_fp8(cupy.from_dlpack(x.view(torch.int16)).view(ml_dtypes.bfloat16)) for x in (q, k, v)]
    descales = {f"{name}_descale": descale for name, (_, descale) in zip("qkv", quantised)}
    bits = [x8 for x8, _ in quantised]
    o_ref, lse_ref = cupy_flash.flash_forward(*bits, causal=True, **descales)
    do = cupy.from_dlpack(weight.view(torch.int16)).view(ml_dtypes.bfloat16)
    expected = [o_ref] + list(cupy_flash.flash_backward(do, *bits, o_ref, lse_ref, causal=True, deterministic=True,
                                                        **descales))
    compiled = torch.compile(attention, fullgraph=True)
    for label, function in (("eager", attention), ("compiled", compiled)):
        results = loss_and_grads(function, (q, k, v))
        for name, ours, want in zip(("o", "dq", "dk", "dv"), results, expected):
            assert ours.dtype == torch.bfloat16, (label, name)
            assert bool((ours.view(torch.int16) == torch.from_dlpack(want.view(numpy.int16))).all()), (label, name)
    halves = loss_and_grads(attention, [x.to(torch.float16) for x in (q, k, v)])
    assert all(x.dtype == torch.float16 for x in halves)


def test_fp8_attention_with_gradients_under_jax_jit():
    """jax_adapter.flash_attention_fp8 under jax.jit and jax.grad: o and dq, dk, dv bitwise those of
    the CuPy route (quantize_fp8, the FP8 flash_forward, the FP8 flash_backward, deterministic)."""
    import cupy

    jax = jax_on_gpu()
    jnp = jax.numpy
    from cupy_flash.jax_adapter import flash_attention_fp8

    keys = jax.random.split(jax.random.PRNGKey(4), 4)
    q, k, v = (jax.random.normal(key, (2, n, h, 64), dtype=jnp.float32).astype(jnp.bfloat16)
               for key, (n, h) in zip(keys, ((150, 4), (170, 2), (170, 2))))
    weight = jax.random.normal(keys[3], (2, 150, 4, 64), dtype=jnp.float32).astype(jnp.bfloat16)

    def attention(q, k, v):
        return flash_attention_fp8(q, k, v, causal=True, deterministic=True)

    def loss(q, k, v):
        return (attention(q, k, v).astype(jnp.float32) * weight.astype(jnp.float32)).sum()

    o = jax.jit(attention)(q, k, v)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

    def as_cupy(x):   # bfloat16 through its bits
        return cupy.from_dlpack(jax.lax.bitcast_convert_type(x, jnp.uint16)).view(ml_dtypes.bfloat16)

    quantised = [quantize_fp8(as_cupy(x)) for x in (q, k, v)]
    descales = {f"{name}_descale": descale for name, (_, descale) in zip("qkv", quantised)}
    bits = [x8 for x8, _ in quantised]
    o_ref, lse_ref = cupy_flash.flash_forward(*bits, causal=True, **descales)
    expected = [o_ref] + list(cupy_flash.flash_backward(as_cupy(weight), *bits, o_ref, lse_ref, causal=True,
                                                        deterministic=True, **descales))
    for name, ours, want in zip(("o", "dq", "dk", "dv"), [o, *grads], expected):
        assert ours.dtype == jnp.bfloat16, name
        assert bool((as_cupy(ours).view(numpy.uint16) == want.view(numpy.uint16)).all()), name


def test_fp8_through_the_pytorch_adapter_under_torch_compile():
    """torch.compile(fullgraph=True) of a function calling flash_attn_func on float8 tensors traces
    the op cupy_flash::forward_fp8: the eager O bitwise, with CUDA descales and with CPU ones (host
    descales), and under a CUDA graph (mode='reduce-overhead') with CUDA descales."""
    torch = torch_on_gpu()
    from cupy_flash.torch_adapter import flash_attn_func

    inputs, descales, (expected, _) = _expected_for_frameworks()
    q, k, v = (torch.from_dlpack(x).view(torch.float8_e4m3fn) for x in inputs)
    on_gpu = {name: torch.from_dlpack(x) for name, x in descales.items()}
    on_host = {name: x.cpu() for name, x in on_gpu.items()}
    want = torch.from_dlpack(expected.view(numpy.int16))

    def attention(q, k, v, q_descale, k_descale, v_descale):
        return flash_attn_func(q, k, v, causal=True, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale) * 2

    for label, mode, scales in (("gpu", None, on_gpu), ("host", None, on_host), ("graph", "reduce-overhead", on_gpu)):
        compiled = torch.compile(attention, fullgraph=True, mode=mode)
        for _ in range(3):   # the graph mode records on a later call
            o = compiled(q, k, v, **scales)
        torch.cuda.synchronize()
        assert o.dtype == torch.bfloat16
        assert bool(((o / 2).view(torch.int16) == want).all()), label
