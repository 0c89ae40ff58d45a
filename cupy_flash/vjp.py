"""``flash_vjp``: forward now, a pullback for the backward later, for manual-gradient code."""

from __future__ import annotations

from .backward import flash_backward
from .forward import flash_forward


def flash_vjp(q, k, v, *, stream=None, **options):
    """``o, pullback = flash_vjp(q, k, v, **options)``; later ``pullback(do)`` returns the gradients
    ``flash_backward(do, q, k, v, o, lse, **options)`` would: (dq, dk, dv), then dsink with
    ``sink``, then dbias with ``pullback(do, return_dbias=True)``.

    options are flash_forward's (causal, window_size, softcap, alibi_slopes, sink, bias, packed
    batches' cu_seqlens, softmax_scale); the pullback holds o, the float32 lse and references to
    the inputs, nothing else (no scores, no copies). ``pullback(do, deterministic=True)`` takes the
    deterministic dQ pass. Both run on ``stream`` (default: CuPy's current stream at each call) unless
    the pullback is given its own.
    """
    backward_options = {name: value for name, value in options.items() if name != "num_splits"}
    o, lse = flash_forward(q, k, v, stream=stream, **options)

    def pullback(do, *, deterministic=False, return_dbias=False, stream=stream):
        return flash_backward(do, q, k, v, o, lse, deterministic=deterministic, return_dbias=return_dbias,
                              stream=stream, **backward_options)

    return o, pullback
