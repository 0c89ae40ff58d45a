"""Dense attention reference, forward and hand-derived backward, on NumPy or CuPy arrays.

It materialises the (batch, heads, seqlen_q, seqlen_k) scores, so it is for testing small and
medium shapes. ``upcast=True`` (the default) computes in float64: the ground truth.
``upcast=False`` computes the same formulas the way a dense implementation in the input's
precision would: float32 arithmetic with every stage's result (scores, probabilities, outputs,
each gradient product) rounded to the input dtype. The tests' error rule compares the kernels'
error against the error of that low-precision reference.
"""

from __future__ import annotations

import math

import numpy

from . import _checks


def _xp(x):
    try:
        import cupy

        return cupy.get_array_module(x)
    except ImportError:  # pragma: no cover - cupy is a dependency
        return numpy


def _is_bfloat16(dtype) -> bool:
    return _checks.dtype_name(dtype) == "bfloat16"


def _to_float(x, xp, dtype):
    """x as ``dtype`` (float32 or float64), reading bfloat16 by its bits so no array library needs
    bfloat16 arithmetic."""
    if _is_bfloat16(x.dtype):
        x = (xp.ascontiguousarray(x).view(xp.uint16).astype(xp.uint32) << 16).view(xp.float32)
    return x.astype(dtype)


def round_to_dtype(x, dtype, xp=None):
    """float32 array x rounded (to nearest even) to ``dtype``'s precision, returned as float32."""
    xp = xp or _xp(x)
    x = x.astype(xp.float32)
    name = _checks.dtype_name(dtype)
    if name == "float16":
        with numpy.errstate(over="ignore"):   # overflow to inf is the correct rounding
            return x.astype(xp.float16).astype(xp.float32)
    if name == "bfloat16":
        bits = xp.ascontiguousarray(x).view(xp.uint32)
        keep_even = (bits >> 16) & 1
        rounded = ((bits + 0x7FFF + keep_even) & 0xFFFF0000).astype(xp.uint32)
        # NaN must stay NaN (the carry could turn a NaN payload into inf).
        return xp.where(xp.isnan(x), x, rounded.view(xp.float32))
    return x


def _bhnd(x):
    """(batch, seqlen, heads, d) -> (batch, heads, seqlen, d)."""
    return x.transpose(0, 2, 1, 3)


def _visible(seqlen_q, seqlen_k, causal, xp):
    """Boolean (seqlen_q, seqlen_k) mask of the keys each query sees, or None for all."""
    if not causal:
        return None
    rows = xp.arange(seqlen_q)[:, None]
    cols = xp.arange(seqlen_k)[None, :]
    return cols <= rows + (seqlen_k - seqlen_q)


def _softmax_parts(q, k, v, softmax_scale, causal, upcast):
    """(work dtype, rounding fn, xp, scale, Q, K, V, P, lse) in (batch, heads, seqlen, d) layout."""
    xp = _xp(q)
    dtype = q.dtype
    work = xp.float64 if upcast else xp.float32
    rnd = (lambda a: a) if upcast else (lambda a: round_to_dtype(a, dtype, xp))
    head_dim = q.shape[-1]
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    Q, K, V = (_bhnd(_to_float(x, xp, work)) for x in (q, k, v))
    scores = rnd(scale * (Q @ K.swapaxes(-1, -2)))
    visible = _visible(q.shape[1], k.shape[1], causal, xp)
    if visible is not None:
        scores = xp.where(visible, scores, -xp.inf)
    row_max = scores.max(axis=-1, keepdims=True)
    # Rows that see no key: max -inf; shifting by 0 keeps exp at 0 instead of NaN.
    row_max = xp.where(xp.isfinite(row_max), row_max, 0.0)
    unnormalised = xp.exp(scores - row_max)
    row_sum = unnormalised.sum(axis=-1, keepdims=True)
    safe_sum = xp.where(row_sum > 0, row_sum, 1.0)
    P = rnd(unnormalised / safe_sum)
    lse = xp.where(row_sum > 0, row_max + xp.log(safe_sum), -xp.inf)[..., 0]
    return work, rnd, xp, scale, Q, K, V, P, lse


def attention_reference(q, k, v, *, softmax_scale=None, causal=False, upcast=True):
    """Dense attention. Returns ``(o, lse)``: o of shape (batch, seqlen_q, heads, head_dim) and lse
    of shape (batch, heads, seqlen_q), float64 when ``upcast`` (else float32 holding values rounded
    to the input dtype; lse stays float32). Same conventions as ``flash_forward``: bottom-right
    causal alignment, o = 0 and lse = -inf for a row that sees no key."""
    _, rnd, xp, _, _, _, V, P, lse = _softmax_parts(q, k, v, softmax_scale, causal, upcast)
    o = rnd(P @ V)
    return _bhnd(o), lse.astype(xp.float64 if upcast else xp.float32)


def attention_reference_backward(do, q, k, v, *, softmax_scale=None, causal=False, upcast=True):
    """Hand-derived gradients of ``attention_reference``'s o with respect to q, k, v, given do:

        dV = P^T dO,  dP = dO V^T,  dS = P * (dP - rowsum(P * dP)),
        dQ = scale * dS K,  dK = scale * dS^T Q

    (rowsum(P * dP) = rowsum(dO * O), the "delta" of FlashAttention). Returns (dq, dk, dv) in the
    layout of q, k, v; float64 when ``upcast``, else float32 rounded stage by stage to the dtype."""
    work, rnd, xp, scale, Q, K, V, P, _ = _softmax_parts(q, k, v, softmax_scale, causal, upcast)
    dO = _bhnd(_to_float(do, xp, work))
    dV = rnd(P.swapaxes(-1, -2) @ dO)
    dP = rnd(dO @ V.swapaxes(-1, -2))
    delta = (P * dP).sum(axis=-1, keepdims=True)
    dS = rnd(P * (dP - delta))
    dQ = rnd(scale * (dS @ K))
    dK = rnd(scale * (dS.swapaxes(-1, -2) @ Q))
    return _bhnd(dQ), _bhnd(dK), _bhnd(dV)
