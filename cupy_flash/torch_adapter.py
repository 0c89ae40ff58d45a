"""PyTorch adapter (imported only when used): ``flash_attn_func`` as a ``torch.autograd.Function``.

    from cupy_flash.torch_adapter import flash_attn_func
    o = flash_attn_func(q, k, v, causal=True)      # q (batch, seqlen_q, heads_q, d), CUDA tensors
    o.sum().backward()                              # q.grad, k.grad, v.grad (and sink.grad)

Tensors pass both ways through DLPack without a copy, and the kernels run on PyTorch's current
stream, so the call orders with the PyTorch work around it. Options are flash_forward's; ``sink``
and ``bias`` may be tensors that require grad (bias gets its gradient reduced to its own shape).
"""

from __future__ import annotations

import torch

from .backward import flash_backward
from .forward import flash_forward


def to_torch(array):
    """A torch tensor over a CuPy array's memory (bfloat16 through its bits: DLPack export of a
    bfloat16 CuPy array is not universal)."""
    if array.dtype.itemsize == 2 and array.dtype.kind == "V" or "bfloat16" in str(array.dtype):
        import cupy

        return torch.from_dlpack(array.view(cupy.uint16)).view(torch.bfloat16)
    return torch.from_dlpack(array)


class FlashAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sink, bias, options):
        # DLPack refuses tensors that require grad; detached views share the memory.
        q, k, v, sink, bias = (None if x is None else x.detach() for x in (q, k, v, sink, bias))
        stream = torch.cuda.current_stream(q.device)
        extra = {name: x for name, x in (("sink", sink), ("bias", bias)) if x is not None}
        o, lse = flash_forward(q, k, v, stream=stream, **extra, **options)
        o, lse = to_torch(o), to_torch(lse)
        ctx.save_for_backward(q, k, v, o, lse, sink, bias)
        ctx.options = options
        return o

    @staticmethod
    def backward(ctx, do):
        # The saved output o requires grad (autograd marks it): detached views again for DLPack.
        q, k, v, o, lse, sink, bias = (None if x is None else x.detach() for x in ctx.saved_tensors)
        stream = torch.cuda.current_stream(q.device)
        extra = {name: x for name, x in (("sink", sink), ("bias", bias)) if x is not None}
        want_dbias = bias is not None and ctx.needs_input_grad[4]
        grads = flash_backward(do.detach().contiguous(), q, k, v, o, lse, stream=stream, return_dbias=want_dbias,
                               **extra, **ctx.options)
        grads = [to_torch(g) for g in grads]
        dq, dk, dv = grads[:3]
        dsink = grads[3] if sink is not None else None
        dbias = grads[-1] if want_dbias else None
        return dq, dk, dv, dsink, dbias, None


def flash_attn_func(q, k, v, *, sink=None, bias=None, **options):
    """Exact attention with gradients through PyTorch's autograd; options as flash_forward's."""
    return FlashAttentionFunction.apply(q, k, v, sink, bias, options)
