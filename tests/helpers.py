"""Test helpers: GPU detection, input generation, NaN poisoning, and the error rule."""

from __future__ import annotations

import collections
import contextlib
import math
import types

import ml_dtypes
import numpy
import pytest
from hypothesis import strategies as st

DTYPES = {"float16": numpy.dtype(numpy.float16), "bfloat16": numpy.dtype(ml_dtypes.bfloat16),
          "float32": numpy.dtype(numpy.float32)}


def _gpu_status():
    from cupy_flash._device import gpu_problem

    problem = gpu_problem()   # no driver, an old one, no GPU: said as such (not CuPy's "insufficient driver")
    return problem is None, problem or ""


HAS_GPU, NO_GPU_REASON = _gpu_status()
requires_gpu = pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON or "GPU present")


def _is_hopper() -> bool:
    if not HAS_GPU:
        return False
    import cupy

    return int(cupy.cuda.Device().compute_capability) == 90


# Kernel paths the forward tests run: "portable" (mma.sync / CUDA cores, on every GPU) and "hopper"
# (the sm_90a family, on compute capability 9.0 only). Each test asserts that a call it expects on
# the Hopper family did run there, so a dispatch change cannot turn the hopper runs into portable ones.
requires_hopper = pytest.mark.skipif(not _is_hopper(), reason="the Hopper kernels need compute capability 9.0")
KERNEL_PATHS = [pytest.param("portable", id="portable"), pytest.param("hopper", id="hopper", marks=requires_hopper)]


# Under "hopper", plain causal forward calls take the plain tiles (sm90.FORWARD_SM90_PLAIN) from
# this many keys instead of the table's threshold (2k), so the property draws (seqlen 1-200,
# 200-1200, 1200-3000) run both tile shapes of a causal call.
HOPPER_TEST_PLAIN_CAUSAL_MIN_KEYS = 200


@contextlib.contextmanager
def kernel_path(path: str):
    """Calls inside dispatch as ``path`` asks. "hopper": every Hopper kernel, those still opted into
    with CUPY_FLASH_KERNELS=experimental included (the backward; the forward dispatches the same
    under "auto" and "experimental"), plain causal calls from HOPPER_TEST_PLAIN_CAUSAL_MIN_KEYS keys on
    the plain tiles."""
    from cupy_flash import families, forward

    tiles = forward.plain_causal_tiles_from(HOPPER_TEST_PLAIN_CAUSAL_MIN_KEYS) if path == "hopper" else contextlib.nullcontext()
    with tiles, families.use_kernels("portable" if path == "portable" else "experimental"):
        yield


def launched_family(launched) -> str:
    """The family that ran a call's kernels, as families.recording() noted them: a forward family's
    name, "decode" (the split-KV path of few query rows per K/V head), or a backward family's."""
    names = {family for family, _ in launched}
    assert len(names) == 1, launched
    return names.pop()


def launched_kernels(launched) -> list:
    """The kernels a call launched (template instantiations), in order, as families.recording() noted them."""
    return [name for _, names in launched for name in names]


# The widest head dim (q's, k's or v's) the Hopper backward takes; wider calls run the portable one.
# (The Hopper forward takes every head dim, to 512.)
HOPPER_BACKWARD_WIDEST_HEAD_DIM = 256


def expect_hopper_family(path: str, family: str, dtype: str, head_dim: int, features: dict) -> None:
    """Under "hopper", every float16/bfloat16 forward without a bias runs the Hopper family, stated
    here apart from the dispatch code (``head_dim``: the widest of q's and v's)."""
    count_example(f"forward on {family}")
    if path != "hopper" or family == "decode":
        return
    portable = dtype == "float32" or features.get("bias") is not None
    assert family == ("forward_tc" if dtype != "float32" and portable else "forward" if portable else "forward_sm90"), (
        family, dtype, head_dim, sorted(features))


def expect_hopper_backward(path: str, family: str, dtype: str, head_dim: int, features: dict,
                           deterministic: bool) -> None:   # family: launched_family's
    """Under "hopper", every float16/bfloat16 backward with no softcap, ALiBi or
    bias and head dims to 256 runs the Hopper backward (deterministic too) (a sink enters only
    through lse and dsink, outside the kernel), stated apart from the dispatch code (``head_dim``:
    the widest of q's and v's)."""
    count_example(f"backward on {family}")
    if path != "hopper":
        return
    modified = features.get("softcap", 0.0) != 0.0 or any(features.get(n) is not None for n in ("alibi_slopes", "bias"))
    hopper = dtype != "float32" and not modified and head_dim <= HOPPER_BACKWARD_WIDEST_HEAD_DIM
    portable = family in ("backward_tc", "backward")
    assert family == "backward_sm90" if hopper else portable, (family, dtype, head_dim, sorted(features), deterministic)


def torch_on_gpu():
    """PyTorch, or a skip where it is absent or sees no GPU."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("this PyTorch sees no GPU")
    return torch


def jax_on_gpu():
    """JAX with jax.ffi, or a skip where it is absent or sees no GPU."""
    jax = pytest.importorskip("jax")
    pytest.importorskip("jax.ffi")
    if not any(device.platform == "gpu" for device in jax.devices()):
        pytest.skip("this JAX sees no GPU")
    return jax


# ---------------------------------------------------------------------------------------------
# Figures printed at the end of the run (conftest.pytest_terminal_summary).

# quantity -> (max of error / allowed bound, error / low-precision error there, example)
WORST_USED: dict[str, tuple[float, float, str]] = {}
EXAMPLES = collections.Counter()
NOTES: list[str] = []   # other figures worth quoting (memory use)


def count_example(prop: str) -> None:
    EXAMPLES[prop] += 1


# ---------------------------------------------------------------------------------------------
# Inputs.

class FakeGpuArray:
    """What the launch code reads of a kernel-ready GPU array, on the CPU: shape, ndim, strides in
    bytes (C-contiguous unless given), dtype.itemsize and data.ptr."""

    def __init__(self, shape, strides=None, ptr=1 << 20, itemsize=2):
        if strides is None:
            strides = tuple(itemsize * int(numpy.prod(shape[i + 1:], dtype=numpy.int64)) for i in range(len(shape)))
        self.shape, self.strides, self.ndim = tuple(shape), tuple(strides), len(shape)
        self.dtype = types.SimpleNamespace(itemsize=itemsize)
        self.data = types.SimpleNamespace(ptr=ptr)


def random_array(rng, shape, dtype, magnitude=1.0, xp=None):
    """Normal(0, magnitude^2) values rounded to ``dtype``; on the GPU unless xp is numpy."""
    host = (rng.standard_normal(shape, dtype=numpy.float32) * numpy.float32(magnitude)).astype(DTYPES[dtype] if isinstance(dtype, str) else dtype)
    if xp is numpy:
        return host
    import cupy

    return cupy.asarray(host)


def as_float64(x):
    """float64 copy of a NumPy/CuPy array of any supported dtype (bfloat16 read by its bits)."""
    from cupy_flash.reference import _to_float, _xp

    xp = _xp(x)
    return _to_float(x, xp, xp.float64)


@contextlib.contextmanager
def poisoned_allocations():
    """Every CuPy allocation made inside is filled with 0xFF bytes (NaN in float16, bfloat16 and
    float32) before use, so an output or workspace element a kernel forgets to write is NaN. The
    short calls' kept workspaces (_launch.kept_workspace) are dropped on the way in and made
    afresh, poisoned, inside."""
    import cupy

    from cupy_flash import _launch

    pool = cupy.get_default_memory_pool()

    def allocate(size):
        memory = pool.malloc(size)
        if size:
            cupy.cuda.runtime.memsetAsync(memory.ptr, 0xFF, size, cupy.cuda.get_current_stream().ptr)
        return memory

    def kept_bytes(nbytes, stream):
        workspace = pool_bytes(nbytes, stream)
        cupy.cuda.runtime.memsetAsync(workspace.data.ptr, 0xFF, workspace.nbytes, stream)
        return workspace

    if not cupy.cuda.get_current_stream().is_capturing():
        cupy.cuda.Device().synchronize()   # no queued kernel still uses a kept workspace
        _launch._workspaces.clear()
    pool_bytes, _launch._pool_bytes = _launch._pool_bytes, kept_bytes
    try:
        with cupy.cuda.using_allocator(allocate):
            yield
    finally:
        _launch._pool_bytes = pool_bytes


def bitwise(x):
    """Integer view of an array, for bitwise comparisons (NaN == NaN, -0 != 0)."""
    return x.view({1: "u1", 2: "u2", 4: "u4", 8: "u8"}[x.dtype.itemsize])


# ---------------------------------------------------------------------------------------------
# The error rule (as FlashAttention's tests): our max error against float64 is at most twice the
# max error of a dense reference computed in the input's precision, plus a tiny floor, relative to
# the magnitude of the values (never below 1e-5 absolute, FlashAttention's own floor):
#   floor = max(1e-5, 4 * 2^-24 * max|lse|) * max(1, max|exact|)
# The second term is float32's resolution at the logits: lse is stored in float32 (the API), so
# the backward's recomputed P = exp(s * scale - lse) carries ~2^-24 * |lse| relative error, while
# a dense reference can be exact (one key: P = 1). It matters only for |lse| > 40.
# Gradients add a third term, 2^-24 * max(sum of |terms|) (gradient_term_scales): dS = P (dP - delta)
# subtracts two float32 dot products, so where the exact gradient cancels to ~0 (one key: dK = 0)
# float32 leaves noise relative to the size of the terms, not of their cancelled sum.
# And a fourth, delta_term (the "delta:" entries of gradient_term_scales): FlashAttention's
# delta = rowsum(dO * O) is taken from the O the caller passes, rounded to the dtype, while a dense
# reference takes rowsum(P * dP) in its own precision. Each O_ic's rounding is an independent error
# of at most u |O_ic| (u = 2^-8 bf16, 2^-11 f16, 2^-24 f32), so delta_i shifts by a sum with
# standard deviation <= u / sqrt(3) * ||dO_i * O_i||_2; the term is three of those deviations,
# carried to first order through dS_ij = P_ij (dP_ij - delta_i) into dQ, dK, dsink and dbias
# (independent rows added in quadrature). It matters where dP - delta cancels: a row dominated by
# one key with a sink holding the rest (one key, d=8, bf16: 2.3-4.3x the dense error without it,
# device run of 2026-11-22); on ordinary shapes it is a small part of the bound
# (test_reference.py::test_delta_term_leaves_the_rule_tight). Where the tests have the O they pass
# (our forward's), delta shifts by exactly rowsum(dO * (O - exact O)); the term takes that where it
# is the larger: that error is the forward's, held to its own rule. In float32 at logits in the
# hundreds the forward's O is ~1e-4 off (exp2 of scores times a rounded scale * log2(e)), far beyond
# O's rounding, and dQ inherits it where dP - delta cancels (3 queries, 428 keys, d=248, logit_std
# 300: dq 6x the dense float32 error, device draw of 2026-11-26).
# Outputs and gradients are held against the larger error of two dense forms (attention_reference's and
# attention_reference_backward's rounding="dense" and "flash"): each rounds P once, and on an output of few elements (one key and a
# sink, d=8) which of them rounds well is a lottery: the kernel's 1.5 ulp against the dense form's
# lucky 0.5 ulp read as 2.8x (device, 2026-11-22). On ordinary shapes the flash form is the more
# accurate (0.05-1.0x the dense error; test_reference.py::test_flash_rounding_leaves_the_rule_tight),
# so the rule there is unchanged.

FLOOR_RELATIVE = 1e-5


def check_error_rule(quantity: str, ours, exact, low_precision, context: str = "", lse_magnitude: float = 0.0,
                     term_scale: float = 0.0, delta_term: float = 0.0, factor: float = 2.0) -> float:
    """Assert the rule for one output; returns our error / the low-precision error. low_precision
    is one dense low-precision result or a tuple of them (two dense forms): the larger error counts.
    factor: 2 (our kernels hold outputs and gradients to it); the rule allows gradients 3."""
    xp = _array_module(exact)
    ours = as_float64(ours)
    forms = low_precision if isinstance(low_precision, tuple) else (low_precision,)
    assert not bool(xp.isnan(ours).any()), f"{quantity}: NaN in output {context}"
    finite = xp.isfinite(exact)
    # -inf (lse of a row that sees no key) must be reproduced exactly, everything else finite.
    assert bool((xp.isfinite(ours) == finite).all()), f"{quantity}: infinities differ {context}"
    assert bool((ours[~finite] == exact[~finite]).all()), f"{quantity}: infinities differ {context}"
    zero = xp.zeros((), dtype=xp.float64)
    err = float(xp.where(finite, xp.abs(ours - exact), zero).max()) if ours.size else 0.0
    low = max(float(xp.where(finite, xp.abs(as_float64(form) - exact), zero).max()) for form in forms) if ours.size else 0.0
    scale = float(xp.where(finite, xp.abs(exact), zero).max()) if ours.size else 0.0
    floor = max(max(FLOOR_RELATIVE, 4 * 2.0**-24 * lse_magnitude) * max(scale, 1.0), 2.0**-24 * term_scale)
    bound = factor * low + floor + delta_term
    ratio = err / low if low > 0 else (0.0 if err == 0 else float("inf"))
    used = err / bound
    if used > WORST_USED.get(quantity, (-1.0, 0.0, ""))[0]:
        WORST_USED[quantity] = (used, ratio, context)
    assert err <= bound, (f"{quantity}: max error {err:.3e} exceeds {factor:g} x low-precision error {low:.3e} "
                          f"+ floor {floor:.1e} {context}")
    return ratio


def input_magnitude(p) -> float:
    """Std of q and k entries that gives scaled logits of std p['logit_std'] (q.k has std
    magnitude^2 * sqrt(head_dim)); p['softmax_scale'] absent or None means 1/sqrt(head_dim)."""
    scale = p.get("softmax_scale") or p["head_dim"] ** -0.5
    return (p["logit_std"] / (scale * p["head_dim"] ** 0.5)) ** 0.5


def gradient_term_scales(do, q, k, v, softmax_scale=None, causal=False, o=None, **features) -> dict:
    """For dq, dk and dv: the largest sum of |terms| (float64) behind any one element, i.e. the
    gradient computed with every factor replaced by its absolute value (softcap's factor <= 1 left
    out; dk and dv summed over each K/V head's group). ``o``: the O the backward is given (our
    forward's), whose deviation from the exact O enters the delta terms."""
    from cupy_flash.reference import _bhnd, _is_bfloat16, _softmax_parts, _to_float

    work, _, xp, scale, Q, K, V, P, _, extras = _softmax_parts(q, k, v, softmax_scale, causal, True, **features)
    dO = _bhnd(_to_float(do, xp, work))
    abs_do = xp.abs(dO)
    abs_dp = abs_do @ xp.abs(V).swapaxes(-1, -2)
    abs_ds = P * (abs_dp + (P * abs_dp).sum(axis=-1, keepdims=True))
    group = Q.shape[1] // k.shape[2]

    def grouped(x):
        return x.reshape(x.shape[0], -1, group, *x.shape[2:]).sum(axis=2)

    # The stored-O delta term (see above): a shift of delta_i moves dQ_i by exactly
    # scale * shift * sum_j P_ij f_ij K_j (f: softcap's factor); dK, dsink and dbias add rows.
    unit = {2: 2.0**-8 if _is_bfloat16(q.dtype) else 2.0**-11, 4: 2.0**-24}[q.dtype.itemsize]
    exact_o = P @ V
    delta_shift = 3.0 * unit / math.sqrt(3.0) * xp.sqrt(((dO * exact_o) ** 2).sum(axis=-1, keepdims=True))
    if o is not None:   # or exactly by the given O's own error, rowsum(dO * (O - exact O)), where larger
        o_shift = xp.abs((dO * (_bhnd(_to_float(o, xp, work)) - exact_o)).sum(axis=-1, keepdims=True))
        delta_shift = xp.maximum(delta_shift, o_shift)
    dz_shift = P * delta_shift
    ds_shift = dz_shift * (1 - extras["tanh"] ** 2) if "tanh" in extras else dz_shift
    p_factor = P * (1 - extras["tanh"] ** 2) if "tanh" in extras else P

    def quadrature(x, axis):
        return xp.sqrt((x ** 2).sum(axis=axis))

    scales = {"dq": float((scale * (abs_ds @ xp.abs(K))).max()),
              "dk": float(grouped(scale * (abs_ds.swapaxes(-1, -2) @ xp.abs(Q))).max()),
              "dv": float(grouped(P.swapaxes(-1, -2) @ abs_do).max()),
              "delta:dq": float((scale * delta_shift * xp.abs(p_factor @ K)).max()),
              "delta:dk": float(xp.sqrt(grouped(scale**2 * ((ds_shift ** 2).swapaxes(-1, -2) @ Q ** 2))).max())}
    if "sink_prob" in extras:
        scales["delta:dsink"] = float(quadrature(extras["sink_prob"] * delta_shift[..., 0], (0, 2)).max())
    bias = features.get("bias")
    if bias is not None:   # dbias sums dS over the bias's broadcast axes
        dims = (1,) * (4 - bias.ndim) + tuple(bias.shape)
        summed = tuple(axis for axis, n in enumerate(dims) if n == 1 and abs_ds.shape[axis] > 1)
        scales["dbias"] = float((abs_ds.sum(axis=summed) if summed else abs_ds).max())
        scales["delta:dbias"] = float((quadrature(dz_shift, summed) if summed else dz_shift).max())
    return scales


def packed_gradient_term_scales(batch: int, do, q, k, v, o, opts) -> dict:
    """gradient_term_scales of each sequence, combined: the largest of each (dsink's delta term,
    a sum over the batch, in quadrature)."""
    from cupy_flash.reference import features_of_sequence

    cu_q, cu_k = (numpy.asarray(opts[n].get()) for n in ("cu_seqlens_q", "cu_seqlens_k"))
    dense = {n: x for n, x in opts.items() if not n.startswith(("cu_", "max_"))}
    combined = {}
    for b in range(batch):
        rq, rk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if rq.start == rq.stop or rk.start == rk.stop:
            continue
        scales = gradient_term_scales(do[None, rq], q[None, rq], k[None, rk], v[None, rk], o=o[None, rq],
                                      **features_of_sequence(dense, b))
        for name, value in scales.items():
            before = combined.get(name, 0.0)
            combined[name] = math.hypot(before, value) if name == "delta:dsink" else max(before, value)
    return combined


def low_precision_outputs(q, k, v, **options) -> tuple:
    """The two dense low-precision forms of o and of lse, ((o_dense, o_flash), (lse_dense,
    lse_flash)), for check_error_rule: the forward's P is rounded once in either form, and on an
    output of few elements which form rounds well is the same lottery as the gradients' (one
    query, d = 8, bf16 with softcap and ALiBi: the flash form read 2.47x the dense error on the
    device). On ordinary shapes the flash form is 0.3-0.6x the dense error
    (test_reference.py::test_flash_rounding_leaves_the_rule_tight), so the rule there is unchanged."""
    from cupy_flash.reference import low_precision_forward_forms

    return low_precision_forward_forms(q, k, v, **options)


def low_precision_gradients(do, q, k, v, **options) -> list:
    """The two dense low-precision forms of every gradient, for check_error_rule (see above)."""
    from cupy_flash.reference import low_precision_backward_forms

    return low_precision_backward_forms(do, q, k, v, **options)


def max_finite_abs(x) -> float:
    xp = _array_module(x)
    finite = xp.isfinite(x)
    return float(xp.where(finite, xp.abs(x), 0).max()) if x.size and bool(finite.any()) else 0.0


def _array_module(x):
    from cupy_flash.reference import _xp

    return _xp(x)


def draw_window_and_softcap(draw, longest_window: int) -> dict:
    """Hypothesis: half the time each, a window (each side unbounded, short or up to
    ``longest_window``) and a softcap."""
    features = {}
    if draw(st.booleans()):
        size = st.one_of(st.just(-1), st.integers(0, 40), st.integers(40, longest_window))
        features["window_size"] = (draw(size), draw(size))
    if draw(st.booleans()):
        features["softcap"] = draw(st.sampled_from([0.5, 5.0, 30.0]))
    return features


def draw_alibi_slopes(draw, count: int) -> list:
    """Hypothesis: ``count`` ALiBi slopes, powers of two from 1 to 2^-8."""
    return draw(st.lists(st.sampled_from([2.0**-e for e in range(9)]), min_size=count, max_size=count))

