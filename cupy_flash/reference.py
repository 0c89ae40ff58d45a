"""Dense attention reference, forward and hand-derived backward, on NumPy or CuPy arrays.

It materialises the (batch, heads, seqlen_q, seqlen_k) scores, so it is for testing small and
medium shapes. ``upcast=True`` (the default) computes in float64: the ground truth.
``upcast=False`` computes the same formulas the way a dense implementation in the input's
precision would: float32 arithmetic with every stage's result (scores, probabilities, outputs,
each gradient product) rounded to the input dtype. The tests' error rule compares the kernels'
error against the error of that low-precision reference. The backward's ``rounding="flash"``
is the other dense form a low-precision implementation takes (see
``_attention_reference_backward_dense``); the rule uses the larger of the two errors.
"""

from __future__ import annotations

import math

import numpy

from . import _checks
from ._dtypes import as_float as _to_float


def _xp(x):
    try:
        import cupy

        return cupy.get_array_module(x)
    except ImportError:  # pragma: no cover - cupy is a dependency
        return numpy


def _is_bfloat16(dtype) -> bool:
    return _checks.dtype_name(dtype) == "bfloat16"


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


def _visible(seqlen_q, seqlen_k, causal, xp, window_size=None):
    """Boolean (seqlen_q, seqlen_k) mask of the keys each query sees, or None for all: the band
    i + shift - left <= j <= i + shift + right around the bottom-right diagonal (shift =
    seqlen_k - seqlen_q; causal means right = 0; -1 leaves a side unbounded)."""
    left, right = (-1, -1) if window_size is None else (int(window_size[0]), int(window_size[1]))
    if causal:
        right = 0
    if left < 0 and right < 0:
        return None
    offset = xp.arange(seqlen_k)[None, :] - xp.arange(seqlen_q)[:, None] - (seqlen_k - seqlen_q)   # j - i - shift
    visible = xp.ones((seqlen_q, seqlen_k), dtype=bool)
    if right >= 0:
        visible &= offset <= right
    if left >= 0:
        visible &= offset >= -left
    return visible


def _softmax_parts(q, k, v, softmax_scale, causal, upcast, window_size=None, softcap=0.0, alibi_slopes=None,
                   sink=None, bias=None, round_scores=True):
    """(work dtype, rounding fn, xp, scale, Q, K, V, P, lse, extras) in (batch, heads, seqlen, d)
    layout, K and V repeated to the query heads (MQA/GQA); extras holds the softcap's tanh and the
    sink's per-row probability for the backward."""
    xp = _xp(q)
    dtype = q.dtype
    work = xp.float64 if upcast else xp.float32
    rnd = (lambda a: a) if upcast else (lambda a: round_to_dtype(a, dtype, xp))
    rnd_scores = rnd if round_scores else (lambda a: a)
    head_dim = q.shape[-1]
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    Q, K, V = (_bhnd(_to_float(x, xp, work)) for x in (q, k, v))
    group = Q.shape[1] // K.shape[1]
    K, V = (xp.repeat(x, group, axis=1) for x in (K, V))
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    scores = rnd_scores(scale * (Q @ K.swapaxes(-1, -2)))
    extras = {}
    if softcap:
        extras["tanh"] = xp.tanh(scores / softcap)
        scores = rnd_scores(softcap * extras["tanh"])
    if alibi_slopes is not None:
        slopes = xp.asarray(alibi_slopes).astype(work)
        slopes = slopes[None, :, None, None] if slopes.ndim == 1 else slopes[:, :, None, None]
        distance = xp.abs(xp.arange(seqlen_k)[None, :] - xp.arange(seqlen_q)[:, None] - (seqlen_k - seqlen_q))
        scores = rnd_scores(scores - slopes * distance.astype(work))
    if bias is not None:   # broadcast to (batch, heads, seqlen_q, seqlen_k)
        scores = rnd_scores(scores + _to_float(xp.asarray(bias), xp, work))
    visible = _visible(seqlen_q, seqlen_k, causal, xp, window_size)
    if visible is not None:
        scores = xp.where(visible, scores, -xp.inf)
    if scores.shape[-1]:
        row_max = scores.max(axis=-1, keepdims=True)
    else:   # a sequence of a packed batch with no keys
        row_max = xp.full(scores.shape[:-1] + (1,), -xp.inf, dtype=scores.dtype)
    sink_logit = None
    if sink is not None:
        sink_logit = xp.asarray(sink).astype(work)[None, :, None, None]
        row_max = xp.maximum(row_max, sink_logit)
    # Rows that see no key: max -inf; shifting by 0 keeps exp at 0 instead of NaN.
    row_max = xp.where(xp.isfinite(row_max), row_max, 0.0)
    unnormalised = xp.exp(scores - row_max)
    row_sum = unnormalised.sum(axis=-1, keepdims=True)
    if sink_logit is not None:
        row_sum = row_sum + xp.exp(sink_logit - row_max)
    safe_sum = xp.where(row_sum > 0, row_sum, 1.0)
    P = rnd_scores(unnormalised / safe_sum)
    lse = xp.where(row_sum > 0, row_max + xp.log(safe_sum), -xp.inf)[..., 0]
    if sink_logit is not None:
        extras["sink_prob"] = xp.exp(sink_logit[..., 0] - lse)
    extras["unnormalised"], extras["row_sum"] = unnormalised, safe_sum
    return work, rnd, xp, scale, Q, K, V, P, lse, extras


def _packed_sequences(features):
    """Per-sequence (b, row slices, features) of a packed batch, or None for a dense call."""
    cu_q, cu_k = features.pop("cu_seqlens_q", None), features.pop("cu_seqlens_k", None)
    features.pop("max_seqlen_q", None)
    features.pop("max_seqlen_k", None)
    if cu_q is None and cu_k is None:
        return None
    cu_q, cu_k = (numpy.asarray(_host(x)).astype(numpy.int64) for x in (cu_q, cu_k))
    return [(slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1])), features_of_sequence(features, b))
            for b in range(len(cu_q) - 1)]


def _keys_of_pages(k, v, features: dict) -> tuple:
    """k and v as a packed batch's (total_k, heads_kv, d) rows: as given, or with ``block_table`` in
    ``features`` (popped) gathered from the paged cache k, v (pages, page_size, heads_kv, d), key j
    of sequence b being row j % page_size of page block_table[b, j // page_size]."""
    block_table = features.pop("block_table", None)
    if block_table is None:
        return k, v
    if features.get("cu_seqlens_q") is None or features.get("cu_seqlens_k") is None:
        raise ValueError("block_table pages K and V of a packed batch: it needs cu_seqlens_q and cu_seqlens_k")
    for name, x in (("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(f"{name} must have 4 dimensions (pages, page_size, heads, head_dim) with block_table, "
                             f"got shape {tuple(getattr(x, 'shape', ()))}")
    table = numpy.asarray(_host(block_table)).astype(numpy.int64)
    lengths = numpy.diff(numpy.asarray(_host(features["cu_seqlens_k"])).astype(numpy.int64))
    pages, page_size = int(k.shape[0]), int(k.shape[1])
    if table.ndim != 2 or table.shape[0] != len(lengths) or lengths.max(initial=0) > table.shape[1] * page_size:
        raise ValueError(f"block_table has shape {table.shape}; expected (batch, pages per sequence) = "
                         f"({len(lengths)}, >= {-(-int(lengths.max(initial=0)) // page_size)})")
    keys = [numpy.arange(n) for n in lengths]
    rows = numpy.concatenate([table[b, j // page_size] * page_size + j % page_size for b, j in enumerate(keys)])
    if rows.size and not 0 <= rows.min() <= rows.max() < pages * page_size:
        raise ValueError(f"block_table names a page outside k's {pages}")
    xp = _xp(k)
    index = xp.asarray(rows)
    return tuple(x.reshape((pages * page_size,) + tuple(x.shape[2:]))[index] for x in (k, v))


def features_of_sequence(features: dict, b: int) -> dict:
    """The feature keywords for batch entry b computed alone: per-batch ALiBi slopes (batch, heads)
    become that entry's (heads,)."""
    own = dict(features)
    slopes = own.get("alibi_slopes")
    if slopes is not None and slopes.ndim == 2:
        own["alibi_slopes"] = slopes[b]
    return own


def _host(x):
    try:
        import cupy

        return cupy.asnumpy(x)
    except ImportError:  # pragma: no cover
        return numpy.asarray(x)


# ---------------------------------------------------------------------------------------------
# Arguments: the public functions check them as the kernel calls do (TypeError / ValueError naming
# the argument), but more widely: any floating dtype (float64 too, and q, k, v of different ones),
# any head_dim, sequences of length 0, NumPy or CuPy (docs/api.md says so).

def _check_array(name: str, x, ranks: tuple) -> None:
    if not (hasattr(x, "shape") and hasattr(x, "dtype") and hasattr(x, "ndim")):
        raise TypeError(f"{name} must be a NumPy or CuPy array, got {type(x).__name__}")
    if numpy.dtype(x.dtype).kind != "f" and not _is_bfloat16(x.dtype):
        raise TypeError(f"{name} has dtype {x.dtype}; expected a floating dtype")
    if x.ndim not in ranks:
        layout = "(batch, seqlen, heads, head_dim)" if 4 in ranks else "(total_tokens, heads, head_dim) with cu_seqlens"
        raise ValueError(f"{name} must have {ranks[0]} dimensions {layout}, got shape {tuple(x.shape)}")


def _check_call(function: str, q, k, v, softmax_scale, causal, upcast, features, **like_o) -> None:
    """Everything ``function`` takes beside the arrays' values; ``like_o``: arrays of o's shape (do):
    q's, with v's head_dim. v's head_dim (head_dim_v, o's) may differ from q's and k's."""
    _checks.check_no_extra_options(function, features)
    packed = features.get("cu_seqlens_q") is not None or features.get("cu_seqlens_k") is not None
    ranks = (3,) if packed else (4,)
    for name, x in (("q", q), ("k", k), ("v", v), *like_o.items()):
        _check_array(name, x, ranks)
    o_shape = tuple(q.shape[:-1]) + (v.shape[-1],)
    for name, x in like_o.items():
        if tuple(x.shape) != o_shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}; expected o's {o_shape} (q's, with v's head_dim)")
    if tuple(v.shape[:-1]) != tuple(k.shape[:-1]):
        raise ValueError(f"v has shape {tuple(v.shape)} but k has shape {tuple(k.shape)}; they must match but in "
                         "the head_dim")
    if k.shape[-1] != q.shape[-1] or (not packed and k.shape[0] != q.shape[0]):
        raise ValueError(f"k has shape {tuple(k.shape)}, which does not match q's {tuple(q.shape)} in batch and head_dim")
    heads, heads_kv = int(q.shape[-2]), int(k.shape[-2])
    if heads_kv < 1 or heads % heads_kv:
        raise ValueError(f"k has {heads_kv} heads but q has {heads}; the query heads must be a multiple of the K/V heads")
    _checks.check_softmax_scale(softmax_scale, int(q.shape[-1]))
    _checks.check_flag("causal", causal)
    _checks.check_flag("upcast", upcast)
    if packed:
        for name in ("cu_seqlens_q", "cu_seqlens_k"):
            if features.get(name) is None:
                raise ValueError(f"{name} is missing: packed batches need both cu_seqlens_q and cu_seqlens_k")
        batch, seqlen_q, seqlen_k = len(features["cu_seqlens_q"]) - 1, 0, 0
    else:
        batch, seqlen_q, seqlen_k = int(q.shape[0]), int(q.shape[1]), int(k.shape[1])
    from ._features import check_variant

    variant = {n: x for n, x in features.items() if n not in _checks.PACKED_KEYWORDS}
    check_variant(batch, heads, bool(causal), seqlen_q=seqlen_q, seqlen_k=seqlen_k, **variant)


def _on_stream(function):
    """``stream=`` as the kernel calls take it: CuPy work of the call runs on that stream (NumPy
    inputs ignore it); CuPy is imported only when a stream is given."""
    import functools
    import inspect

    @functools.wraps(function)
    def wrapper(*args, stream=None, **kwargs):
        if stream is None:
            return function(*args, **kwargs)
        from ._streams import as_cupy_stream

        with as_cupy_stream(stream):
            return function(*args, **kwargs)

    from ._streams import STREAM_DOC, _with_stream

    wrapper.__doc__ = (function.__doc__ or "").rstrip() + "\n" + STREAM_DOC
    wrapper.__signature__ = _with_stream(inspect.signature(function))
    return wrapper


@_on_stream
def attention_reference(q, k, v, *, softmax_scale=None, causal=False, upcast=True, rounding="dense", q_descale=None,
                        k_descale=None, v_descale=None, **features):
    """Dense attention; see ``_attention_reference_dense``. With ``cu_seqlens_q/k`` (a packed
    batch: q (total_q, heads, d)), each sequence separately: o (total_q, heads, d), lse (heads,
    total_q); with ``block_table`` too, k and v are a paged cache as flash_forward reads it. FP8
    inputs (uint8 bits of e4m3 with their descales; ``_fp8_values``) are read as their float64
    values; ``rounding="fp8"`` with ``upcast=False`` rounds as the FP8 scheme does."""
    (q, k, v), fp8 = _fp8_values("attention_reference", dict(q=q, k=k, v=v),
                                 dict(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale), features)
    features = dict(features)
    k, v = _keys_of_pages(k, v, features)
    _check_call("attention_reference", q, k, v, softmax_scale, causal, upcast, features)
    _check_rounding(rounding, fp8, upcast)
    sequences = _packed_sequences(features)
    if sequences is None:
        return _attention_reference_dense(q, k, v, softmax_scale=softmax_scale, causal=causal, upcast=upcast,
                                          rounding=rounding, **features)
    xp = _xp(q)
    outs, lses = [], []
    for rows_q, rows_k, own in sequences:
        o, lse = _attention_reference_dense(q[None, rows_q], k[None, rows_k], v[None, rows_k], softmax_scale=softmax_scale,
                                            causal=causal, upcast=upcast, rounding=rounding, **own)
        outs.append(o[0])
        lses.append(lse[0])
    return xp.concatenate(outs, axis=0), xp.concatenate(lses, axis=1)


@_on_stream
def attention_reference_backward(do, q, k, v, *, softmax_scale=None, causal=False, upcast=True, rounding="dense",
                                 q_descale=None, k_descale=None, v_descale=None, **features):
    """Gradients of ``attention_reference``; see ``_attention_reference_backward_dense``. Packed
    batches (``cu_seqlens_q/k``): each sequence separately, dsink summed over them. FP8 inputs as
    ``attention_reference`` takes them (do in bfloat16 / float16 / float32)."""
    options = {n: x for n, x in features.items() if n != "return_dbias"}
    (q, k, v), fp8 = _fp8_values("attention_reference_backward", dict(q=q, k=k, v=v),
                                 dict(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale), options)
    _checks.check_no_extra_options("attention_reference_backward", options, paged=False)
    _check_call("attention_reference_backward", q, k, v, softmax_scale, causal, upcast, options, do=do)
    _check_rounding(rounding, fp8, upcast)
    _checks.check_flag("return_dbias", features.get("return_dbias", False))
    sequences = _packed_sequences(features)
    if sequences is None:
        return _attention_reference_backward_dense(do, q, k, v, softmax_scale=softmax_scale, causal=causal,
                                                   upcast=upcast, rounding=rounding, **features)
    xp = _xp(q)
    parts = []
    for rows_q, rows_k, own in sequences:
        grads = _attention_reference_backward_dense(do[None, rows_q], q[None, rows_q], k[None, rows_k], v[None, rows_k],
                                                    softmax_scale=softmax_scale, causal=causal, upcast=upcast,
                                                    rounding=rounding, **own)
        parts.append(grads)
    out = tuple(xp.concatenate([g[i][0] for g in parts], axis=0) for i in range(3))
    if len(parts[0]) > 3:
        out += (sum(g[3] for g in parts),)
    return out



def _check_rounding(rounding, fp8: bool = False, upcast: bool = True) -> None:
    if rounding not in ("dense", "flash", "fp8"):
        raise ValueError(f"rounding must be 'dense', 'flash' or 'fp8', got {rounding!r}")
    if rounding == "fp8" and not fp8:
        raise ValueError("rounding='fp8' is the FP8 inputs' scheme: it needs q, k, v in FP8 (uint8 bits of e4m3) "
                         "with q_descale, k_descale and v_descale")
    if fp8 and not upcast and rounding != "fp8":
        raise ValueError(f"FP8 inputs with upcast=False round as the FP8 scheme: rounding='fp8', got {rounding!r}")


# FP8 inputs take these variants (with causal and GQA / MQA); the others raise naming the option.
def _fp8_values(function: str, arrays: dict, descales: dict, features: dict) -> tuple:
    """((q, k, v), fp8): FP8 inputs (``fp8.check_fp8_call``'s) as float64 values
    ``decode(x) * descale`` (q's descale per K/V head taken by each head of its group; packed
    batches: per token, by its sequence); else the arrays unchanged."""
    from .fp8 import check_fp8_call, decode_fp8

    call = check_fp8_call(function, arrays, descales, features)
    if call is None:
        return tuple(arrays.values()), False
    xp = _xp(arrays["q"])
    values = []
    for name, x in arrays.items():
        descale = xp.asarray(descales[f"{name}_descale"], dtype=xp.float64)
        if descale.shape[1] != x.shape[-2]:   # q's descale per K/V head: each head of its group takes it
            descale = xp.repeat(descale, x.shape[-2] // descale.shape[1], axis=1)
        if call.packed:   # each token's sequence
            cu_seqlens = features["cu_seqlens_q" if name == "q" else "cu_seqlens_k"]
            bounds = numpy.asarray(_host(cu_seqlens)).astype(numpy.int64)
            rows_of = xp.asarray(numpy.repeat(numpy.arange(len(bounds) - 1), numpy.diff(bounds)))
            scale = descale[rows_of][:, :, None]
        else:
            scale = descale[:, None, :, None]
        values.append(decode_fp8(x) * scale)
    return tuple(values), True


def low_precision_forward_forms(q, k, v, **options) -> tuple:
    """``attention_reference(..., upcast=False)`` in both dense forms, as ((o_dense, o_flash),
    (lse_dense, lse_flash)): the error rule holds the outputs against the larger error."""
    dense, flash = (attention_reference(q, k, v, upcast=False, rounding=form, **options) for form in ("dense", "flash"))
    return (dense[0], flash[0]), (dense[1], flash[1])


def low_precision_backward_forms(do, q, k, v, **options) -> list:
    """``attention_reference_backward(..., upcast=False)`` in both dense forms ("dense" and "flash"),
    as one (dense, flash) pair per output: the error rule holds gradients against the larger error."""
    return list(zip(*(attention_reference_backward(do, q, k, v, upcast=False, rounding=form, **options)
                      for form in ("dense", "flash"))))

@_on_stream
def decode_reference(q, k_cache, v_cache, *, cache_seqlens, k_new=None, v_new=None, block_table=None,
                     cache_batch_idx=None, cache_leftpad=None, rotary_cos=None, rotary_sin=None,
                     rotary_interleaved=False, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
                     upcast=True, **features):
    """What ``flash_decode`` returns, computed densely per sequence: its keys are the cache's rows
    cache_leftpad[b] (0 without it) to cache_seqlens[b] (gathered through block_table for a paged
    cache, from cache row cache_batch_idx[b] with it) followed by k_new[b]. With rotary_cos /
    rotary_sin, q and k_new are first rotated as flash_decode documents, in float32 and rounded to
    the dtype once (the kernel's scheme, so both read the same rotated values). An FP8 cache
    (uint8 e4m3 bits with k_descale, v_descale): sequence b's rows are decode(bits) x descale[b,
    head] in float64, k_new / v_new first rounded into the cache's bits as flash_decode appends them
    (``fp8.encode_fp8(x / descale)``). The cache arrays are read, never written. Returns (o, lse) as
    ``attention_reference``."""
    unknown = sorted(set(features) - set(_checks.FEATURE_KEYWORDS) | set(features) & set(_checks.PACKED_KEYWORDS + ("bias",)))
    if unknown:
        raise TypeError(f"decode_reference() got unsupported keyword argument(s): {', '.join(unknown)}")
    fp8_cache = k_descale is not None or v_descale is not None
    for name, x in (("q", q),) + (() if fp8_cache else (("k_cache", k_cache), ("v_cache", v_cache))):
        _check_array(name, x, (4,))
    if fp8_cache:
        from .decode import check_fp8_cache

        check_fp8_cache(k_cache, v_cache, k_descale, v_descale)
    for name, x in (("k_new", k_new), ("v_new", v_new)):
        if x is not None:
            _check_array(name, x, (4,))
    if getattr(cache_seqlens, "ndim", None) != 1 or cache_seqlens.shape[0] != q.shape[0]:
        raise ValueError(f"cache_seqlens must be a 1-D array of batch = {q.shape[0]} lengths, got "
                         f"{type(cache_seqlens).__name__} of shape {tuple(getattr(cache_seqlens, 'shape', ()))}")
    _checks.check_softmax_scale(softmax_scale, int(q.shape[-1]))
    _checks.check_flag("causal", causal)
    _checks.check_flag("upcast", upcast)
    from ._features import check_variant

    check_variant(int(q.shape[0]), int(q.shape[2]), bool(causal), **features)
    xp = _xp(q)
    lengths = numpy.asarray(_host(cache_seqlens)).astype(numpy.int64)
    table = None if block_table is None else numpy.asarray(_host(block_table)).astype(numpy.int64)
    batch = int(q.shape[0])
    cache_rows = numpy.arange(batch) if cache_batch_idx is None else numpy.asarray(_host(cache_batch_idx)).astype(numpy.int64)
    first_keys = numpy.zeros(batch, numpy.int64) if cache_leftpad is None else \
        numpy.maximum(numpy.asarray(_host(cache_leftpad)).astype(numpy.int64), 0)
    if rotary_cos is not None:
        window = features.get("window_size")
        q_moves = bool(causal) or (window is not None and tuple(window) != (-1, -1))
        q = rotate(q, rotary_cos, rotary_sin, lengths, q_moves, rotary_interleaved)
        if k_new is not None:
            k_new = rotate(k_new, rotary_cos, rotary_sin, lengths, True, rotary_interleaved)

    def rows_of(cache, b):
        # 16-bit values move as their bits: gathers and concatenation need no bfloat16 support.
        bits = cache.view(xp.uint16) if cache.dtype.itemsize == 2 else cache
        n, first = int(lengths[b]), int(first_keys[b])
        if table is None:
            row = int(cache_rows[b])
            rows = bits[row, first:n] if 0 <= row < cache.shape[0] else bits[0, :0]
        else:
            page_size = cache.shape[1]
            keys = numpy.arange(first, max(n, first))
            rows = bits[xp.asarray(table[b, keys // page_size]), xp.asarray(keys % page_size)]
        return rows

    def descales(descale):   # (batch, heads_kv) float64, as the kernels index them
        host = numpy.asarray(_host(descale)).astype(numpy.float64)
        return xp.asarray(numpy.broadcast_to(host, (batch, int(k_cache.shape[2]))))

    if fp8_cache:
        from .fp8 import decode_fp8, encode_fp8

        k_scales, v_scales = descales(k_descale), descales(v_descale)

    def appended(cache, new, b, scales=None):
        rows = rows_of(cache, b)
        # (a cache_batch_idx row outside the cache: the sequence sees no key, its new rows dropped)
        keeps_new = new is not None and (table is not None or 0 <= int(cache_rows[b]) < cache.shape[0])
        if scales is not None:   # FP8: the new rows' bits as the append writes them, then the values
            if keeps_new:
                rows = xp.concatenate([rows, encode_fp8(_to_float(new[b], xp, xp.float64) / scales[b][:, None])], axis=0)
            return decode_fp8(rows) * scales[b][:, None]
        if keeps_new:
            extra = new.view(xp.uint16) if new.dtype.itemsize == 2 else new
            rows = xp.concatenate([rows, extra[b]], axis=0)
        return rows.view(cache.dtype) if cache.dtype.itemsize == 2 else rows

    outs, lses = [], []
    for b in range(q.shape[0]):
        own = features_of_sequence(features, b)
        keys = appended(k_cache, k_new, b, k_scales if fp8_cache else None)
        values = appended(v_cache, v_new, b, v_scales if fp8_cache else None)
        o, lse = _attention_reference_dense(q[b:b + 1], keys[None], values[None], softmax_scale=softmax_scale,
                                            causal=causal, upcast=upcast, **own)
        outs.append(o)
        lses.append(lse)
    return xp.concatenate(outs, axis=0), xp.concatenate(lses, axis=0)


def rotate(x, cos, sin, cache_seqlens, moves: bool, interleaved: bool = False):
    """x (batch, seqlen, heads, head_dim) of 16-bit floats turned by rotary embedding as flash_decode
    does it: row t of sequence b at position cache_seqlens[b] + t (``moves``) or cache_seqlens[b],
    clamped to cos's rows; columns paired (2i, 2i + 1) (``interleaved``) or (i, i + rotary_dim / 2)
    for i < rotary_dim / 2 = cos.shape[1]; each value x0 c - x1 s or x0 s + x1 c in float32 (every
    operation rounded), then rounded to x's dtype. Returns an array of x's dtype."""
    xp = _xp(x)
    seqlen_ro, half = (int(n) for n in cos.shape)
    lengths = xp.asarray(numpy.asarray(_host(cache_seqlens)).astype(numpy.int64))
    steps = xp.arange(x.shape[1]) if moves else xp.zeros(x.shape[1], dtype=xp.int64)
    positions = xp.clip(lengths[:, None] + steps[None, :], 0, seqlen_ro - 1)            # (batch, seqlen)
    c = _to_float(cos, xp, xp.float32)[positions][:, :, None, :]                          # (batch, seqlen, 1, half)
    s = _to_float(sin, xp, xp.float32)[positions][:, :, None, :]
    f = _to_float(x, xp, xp.float32)
    index = xp.arange(half)
    first, second = (2 * index, 2 * index + 1) if interleaved else (index, index + half)
    x0, x1 = f[..., first], f[..., second]
    out = f.copy()
    out[..., first] = x0 * c - x1 * s
    out[..., second] = x0 * s + x1 * c
    rounded = round_to_dtype(out, x.dtype, xp)
    if _is_bfloat16(x.dtype):
        return (xp.ascontiguousarray(rounded).view(xp.uint32) >> 16).astype(xp.uint16).view(x.dtype)
    return rounded.astype(x.dtype)


def _attention_reference_dense(q, k, v, *, softmax_scale=None, causal=False, upcast=True, rounding="dense",
                               **features):
    """Dense attention. Returns ``(o, lse)``: o of shape (batch, seqlen_q, heads, head_dim) and lse
    of shape (batch, heads, seqlen_q), float64 when ``upcast`` (else float32 holding values rounded
    to the input dtype; lse stays float32). Same conventions and variant keywords as
    ``flash_forward`` (window_size, softcap, alibi_slopes, sink; K/V heads dividing the query
    heads): bottom-right causal alignment, o = 0 and lse = -inf for a row that sees no key (lse =
    the sink's logit when there is one).

    ``rounding="flash"`` (with ``upcast=False``) is the other form a dense implementation in the
    dtype takes, the one FlashAttention computes: scores stay float32, the unnormalised
    exp(s - row_max) is rounded to the dtype as the operand of the PV product, and the float32 row
    sum divides the float32 product. Each form rounds P once; on an output of few elements (one
    query, d = 8) which one rounds well is a lottery: the flash form is over 2x the dense form's
    error in about 0.35% of such draws (CPU emulation of bf16 with softcap 0.5 and ALiBi, up to
    4.7x; a device draw read 2.47x)."""
    if rounding == "fp8" and not upcast:
        return _fp8_forward(q, k, v, softmax_scale, causal, features)
    flash = rounding == "flash" and not upcast
    _, rnd, xp, _, _, _, V, P, lse, extras = _softmax_parts(q, k, v, softmax_scale, causal, upcast,
                                                            round_scores=not flash, **features)
    if flash:
        o = rnd((rnd(extras["unnormalised"]) @ V) / extras["row_sum"])
    else:
        o = rnd(P @ V)
    return _bhnd(o), lse.astype(xp.float64 if upcast else xp.float32)


def _attention_reference_backward_dense(do, q, k, v, *, softmax_scale=None, causal=False, upcast=True,
                                        return_dbias=False, rounding="dense", **features):
    """Hand-derived gradients of ``attention_reference``'s o with respect to q, k, v, given do:

        dV = P^T dO,  dP = dO V^T,  dZ = P * (dP - rowsum(P * dP)),
        dS = dZ * (1 - tanh^2) under softcap (else dZ),
        dQ = scale * dS K,  dK = scale * dS^T Q

    (rowsum(P * dP) = rowsum(dO * O), the "delta" of FlashAttention), with dK and dV summed over
    each K/V head's group of query heads. Returns (dq, dk, dv) in the layout of q, k, v, and with
    ``sink`` also dsink = -sum over batch and rows of P_sink * delta: (dq, dk, dv, dsink); with
    ``return_dbias`` last dbias = dZ summed to the bias's shape. float64 when ``upcast``, else
    float32 rounded stage by stage to the dtype.

    ``rounding="flash"`` (with ``upcast=False``) is the other form a dense implementation in the
    dtype takes, the one that keeps only the float32 lse: scores and dP stay float32 (matrix
    products accumulated in float32, not stored), P and dS are rounded to the dtype only as the
    operands of the products dV = P^T dO, dQ = dS K, dK = dS^T Q, and delta comes from the stored
    O. Neither form is the more accurate one on every input: each rounds P once, and on an output
    with few elements (one key, a few rows) which of them happens to round well is a lottery the
    error rule would otherwise read as a kernel defect (2.8x the dense error at one key with a
    sink, d=8, bf16; about 0.3% of few-key problems in a CPU emulation)."""
    if rounding == "fp8" and not upcast:
        return _fp8_backward(do, q, k, v, softmax_scale, causal, features)
    flash = rounding == "flash" and not upcast
    work, rnd, xp, scale, Q, K, V, P, _, extras = _softmax_parts(q, k, v, softmax_scale, causal, upcast,
                                                                 round_scores=not flash, **features)
    dO = _bhnd(_to_float(do, xp, work))
    # flash: dK and dV stay float32 until summed over a K/V head's group (one rounding at the end)
    rnd_kv = (lambda a: a) if flash else rnd
    dV = rnd_kv(rnd(P).swapaxes(-1, -2) @ dO)
    if flash:
        dP = dO @ V.swapaxes(-1, -2)
        delta = (dO * rnd(P @ V)).sum(axis=-1, keepdims=True)
        dZ = P * (dP - delta)
        dS = rnd(dZ * (1 - extras["tanh"] ** 2) if "tanh" in extras else dZ)
    else:
        dP = rnd(dO @ V.swapaxes(-1, -2))
        # Rounded to the dtype when not upcast, as a dense implementation's softmax backward in that
        # precision stores it (PyTorch's, which FlashAttention's tests compare against, does).
        delta = rnd((P * dP).sum(axis=-1, keepdims=True))
        dS = rnd(P * (dP - delta))
        dZ = dS   # the gradient of the logits (and so of an additive bias)
        if "tanh" in extras:
            dS = rnd(dS * (1 - extras["tanh"] ** 2))
    dQ = rnd(scale * (dS @ K))
    dK = rnd_kv(scale * (dS.swapaxes(-1, -2) @ Q))
    group = Q.shape[1] // k.shape[2]
    if group > 1:   # sum each K/V head's group (rounded once more, as a dense implementation would)
        batch, _, seqlen_k, _ = dK.shape
        dK, dV = (x.reshape(batch, k.shape[2], group, seqlen_k, x.shape[-1]).sum(axis=2) for x in (dK, dV))
    dK, dV = rnd(dK), rnd(dV)
    grads = (_bhnd(dQ), _bhnd(dK), _bhnd(dV))
    if "sink_prob" in extras:
        # delta as rowsum(dO * O) with O as stored (rounded to the dtype when not upcast): the
        # form a dense implementation that keeps O evaluates (equal to rowsum(P * dP) exactly).
        O = rnd(P @ V)
        grads += (-(extras["sink_prob"] * (dO * O).sum(axis=-1)).sum(axis=(0, 2)),)
    if return_dbias:
        bias = features["bias"]
        dims = (1,) * (4 - bias.ndim) + tuple(bias.shape)
        summed = tuple(axis for axis, n in enumerate(dims) if n == 1 and dZ.shape[axis] > 1)
        dbias = dZ.sum(axis=summed, keepdims=True) if summed else dZ
        grads += (dbias.reshape(bias.shape),)
    return grads


# ---------------------------------------------------------------------------------------------
# The FP8 scheme (docs/fp8.md): q, k, v are FP8 values (float64 here), products exact, outputs and
# gradients in bfloat16.

def _fp8_forward(q, k, v, softmax_scale, causal, features):
    """o, lse as the FP8 forward rounds: P = exp(s - row max) enters the P V product as e4m3 of
    P x 2^8 (fp8.P_SCALE), divided by the unrounded row sum; o rounded to bfloat16. (The kernels
    take the row max as it runs over the key blocks; this takes the row's.)"""
    _, _, xp, _, _, _, V, _, lse, extras = _softmax_parts(q, k, v, softmax_scale, causal, True, **features)
    return _bhnd(_fp8_output(V, extras, xp)), lse.astype(xp.float32)


def _fp8_output(V, extras, xp):
    """The FP8 forward's o (batch, heads, seqlen_q, d_v), float32 holding bfloat16 values, from
    _softmax_parts' V and extras (the unnormalised P and its row sum)."""
    from ._dtypes import bfloat16
    from .fp8 import P_SCALE, round_fp8

    operand = round_fp8(extras["unnormalised"] * P_SCALE, "e4m3") / P_SCALE
    return round_to_dtype((operand @ V) / extras["row_sum"], bfloat16(), xp)


def _fp8_backward(do, q, k, v, softmax_scale, causal, features):
    """Gradients as the FP8 backward computes them (docs/fp8.md, "The backward"): the bfloat16
    backward over q, k, v (their dequantised values) rounded to bfloat16, given the FP8 forward's
    lse and o. P = exp(scale q k^T - lse) on the rounded operands with the forward's lse (of the
    exact scores), delta = rowsum(dO o) with the forward's o (P x 2^8 in e4m3); P and dS = P (dP -
    delta) rounded to bfloat16 as the operands of dV = P^T dO, dQ = scale dS K and dK = scale dS^T
    Q; dP, the products and GQA's group sums exact (float32 and better in the kernels); every
    gradient rounded to bfloat16 once (dsink float32)."""
    from ._dtypes import bfloat16

    _, _, xp, scale, _, _, V, _, lse, extras = _softmax_parts(q, k, v, softmax_scale, causal, True, **features)
    rnd = lambda a: round_to_dtype(a, bfloat16(), xp).astype(xp.float64)   # noqa: E731
    O = _fp8_output(V, extras, xp).astype(xp.float64)
    _, _, _, _, Q, K, V, P, lse_rounded, _ = _softmax_parts(*(rnd(x) for x in (q, k, v)), softmax_scale, causal, True,
                                                            **features)
    finite = xp.isfinite(lse)
    P = P * xp.where(finite, xp.exp(lse_rounded - xp.where(finite, lse, 0.0)), 0.0)[..., None]   # exp(s - forward's lse)
    dO = _bhnd(_to_float(do, xp, xp.float64))
    delta = (dO * O).sum(axis=-1, keepdims=True)
    dV = rnd(P).swapaxes(-1, -2) @ dO
    dS = rnd(P * (dO @ V.swapaxes(-1, -2) - delta))
    dQ, dK = scale * (dS @ K), scale * (dS.swapaxes(-1, -2) @ Q)
    group = Q.shape[1] // k.shape[2]
    if group > 1:
        batch, _, seqlen_k, _ = dK.shape
        dK, dV = (x.reshape(batch, k.shape[2], group, seqlen_k, x.shape[-1]).sum(axis=2) for x in (dK, dV))
    grads = tuple(_bhnd(rnd(x).astype(xp.float32)) for x in (dQ, dK, dV))
    if "sink_prob" in extras:
        grads += ((-(extras["sink_prob"] * delta[..., 0]).sum(axis=(0, 2))).astype(xp.float32),)
    return grads
