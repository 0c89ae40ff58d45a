"""Head dims that are not a multiple of 8: padded inside, as FlashAttention-2 does.

The kernels move rows in 16-byte vectors, so they take head dims that are multiples of 8. A call
with another head_dim (q's and k's, or v's) runs on copies whose rows are padded with zeros to the
next multiple of 8: zero columns add nothing to q . k (the scores are exact) and give o, do and the
gradients zero columns, which are cut off. The default softmax_scale stays 1/sqrt of q's real
head_dim. The user sees outputs of the real shapes; the copies are O(batch x seqlen x heads x d).
FP8 calls and flash_decode (whose cache is written in place) take multiples of 16 and 8 only.
"""

from __future__ import annotations

from . import _checks

ROW_MULTIPLE = 8   # elements of a 16-byte vector of a 16-bit type


def needs_padding(q, v) -> bool:
    """Whether q's (and k's) or v's head_dim is not a multiple of 8 (a 16-bit or float32 call)."""
    return any(getattr(x, "ndim", 0) in (3, 4) and int(x.shape[-1]) % ROW_MULTIPLE for x in (q, v))


def _check_head_dims(q, k, v) -> tuple[int, int]:
    """(q's head_dim, v's): check_qkv's checks of the shapes as they are, any head dim up to 256 (a
    packed batch's (total, heads, d) arrays as a batch of one); the rest run on the padded arrays."""
    ranks = {getattr(x, "ndim", None) for x in (q, k, v)}
    if len(ranks) != 1 or ranks.pop() not in (3, 4):
        return int(q.shape[-1]), int(v.shape[-1])   # the full checks name the array of the wrong rank
    shape = _checks.check_qkv(*(_checks._ShapeOf(x) if x.ndim == 3 else x for x in (q, k, v)), any_head_dim=True)
    return shape.head_dim, shape.head_dim_v


def _padded(x, width: int):
    """x with its last axis zero-padded to ``width`` (a new C-contiguous array; x is not modified)."""
    import cupy

    out = cupy.zeros(tuple(x.shape[:-1]) + (width,), dtype=x.dtype)
    out[..., :x.shape[-1]] = x
    return out


def _row_width(d: int) -> int:
    return -(-d // ROW_MULTIPLE) * ROW_MULTIPLE


def _cut(x, width: int):
    """The first ``width`` columns of x, C-contiguous."""
    import cupy

    return cupy.ascontiguousarray(x[..., :width])


def _into(out, results: tuple) -> tuple:
    """``results`` copied into the caller's ``out`` buffers (the adapters'), or returned as they are."""
    if out is None:
        return results
    for buffer, result in zip(out, results):
        _checks.as_gpu_array("out", buffer)[...] = result
    return tuple(out) + results[len(out):]


def forward(forward_into, out, q, k, v, softmax_scale, causal, num_splits, features) -> tuple:
    """flash_forward (``forward_into``) on q, k, v padded to whole 16-byte rows; (o, lse) of the
    real shapes, written into ``out`` where given."""
    head_dim, head_dim_v = _check_head_dims(q, k, v)
    scale = _checks.check_softmax_scale(softmax_scale, head_dim)
    q, k, v = (_checks.as_gpu_array(n, x) for n, x in (("q", q), ("k", k), ("v", v)))
    with q.device:
        padded = [_padded(x, _row_width(d)) for x, d in ((q, head_dim), (k, head_dim), (v, head_dim_v))]
        o, lse = forward_into(None, *padded, softmax_scale=scale, causal=causal, num_splits=num_splits, **features)
        return _into(out, (_cut(o, head_dim_v), lse))


def backward(backward_into, out, do, q, k, v, o, lse, softmax_scale, causal, deterministic, return_dbias,
             features) -> tuple:
    """flash_backward (``backward_into``) on do, q, k, v, o padded to whole 16-byte rows; dq, dk, dv
    of the real shapes (written into ``out`` where given), then dsink and dbias as asked for."""
    head_dim, head_dim_v = _check_head_dims(q, k, v)
    scale = _checks.check_softmax_scale(softmax_scale, head_dim)
    names = ("do", "q", "k", "v", "o")
    do, q, k, v, o = (_checks.as_gpu_array(n, x) for n, x in zip(names, (do, q, k, v, o)))
    for name, x in (("do", do), ("o", o)):
        if getattr(x, "ndim", None) != q.ndim or int(x.shape[-1]) != head_dim_v:
            raise ValueError(f"{name} has shape {tuple(x.shape)}; expected o's {tuple(q.shape[:-1]) + (head_dim_v,)} "
                             "(q's, with v's head_dim)")
    with q.device:
        widths = (head_dim_v, head_dim, head_dim, head_dim_v, head_dim_v)
        padded = [_padded(x, _row_width(d)) for x, d in zip((do, q, k, v, o), widths)]
        grads = backward_into(None, *padded, lse, softmax_scale=scale, causal=causal, deterministic=deterministic,
                              return_dbias=return_dbias, **features)
        cut = tuple(_cut(g, d) for g, d in zip(grads[:3], (head_dim, head_dim, head_dim_v)))
        return _into(out, cut + tuple(grads[3:]))
