"""PyTorch adapter (imported only when used): ``flash_attn_func`` as ``torch.library`` custom ops.

    from cupy_flash.torch_adapter import flash_attn_func
    o = flash_attn_func(q, k, v, causal=True)      # q (batch, seqlen_q, heads_q, d), CUDA tensors
    o.sum().backward()                              # q.grad, k.grad, v.grad (and sink.grad, bias.grad)

The forward and the backward are the custom ops ``torch.ops.cupy_flash.forward`` and
``torch.ops.cupy_flash.backward``, each with a fake (meta) implementation giving its outputs'
shapes, and the autograd formula registered on the forward. So ``torch.compile(fullgraph=True)``
traces a model that calls them without graph breaks, and CUDA graphs capture them.

Tensors pass both ways through DLPack without a copy; the outputs are PyTorch tensors the op
allocates and the kernels write into, and the kernels' temporaries come from PyTorch's caching
allocator (so a CUDA-graph capture keeps them in its private pool). The kernels run on PyTorch's
current stream. Options are flash_forward's: softmax_scale, causal, window_size, softcap,
alibi_slopes, sink, bias, cu_seqlens_q/k with max_seqlen_q/k, and the backward's deterministic.
q, k, v, sink and bias may require grad (bias gets its gradient reduced to its own shape).
"""

import contextlib
from typing import Optional

import torch

from .backward import backward_into
from .forward import forward_into

_TENSOR_OPTIONS = ("alibi_slopes", "cu_seqlens_q", "cu_seqlens_k")
_STATIC_OPTIONS = ("max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal", "window_size", "softcap")
_OPTIONS = _TENSOR_OPTIONS + _STATIC_OPTIONS + ("deterministic",)


def to_torch(array):
    """A torch tensor over a CuPy array's memory (bfloat16 through its bits: DLPack export of a
    bfloat16 CuPy array is not universal)."""
    if array.dtype.itemsize == 2 and array.dtype.kind == "V" or "bfloat16" in str(array.dtype):
        import cupy

        return torch.from_dlpack(array.view(cupy.uint16)).view(torch.bfloat16)
    return torch.from_dlpack(array)


def flash_attn_func(q, k, v, *, sink=None, bias=None, deterministic=False, **options):
    """Exact attention with gradients through PyTorch's autograd; options as flash_forward's."""
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise TypeError(f"flash_attn_func got unexpected option(s) {unknown}; it takes {sorted(_OPTIONS + ('sink', 'bias'))}")
    window = options.get("window_size")
    o, _ = torch.ops.cupy_flash.forward(
        q, k, v, sink, bias, options.get("alibi_slopes"), options.get("cu_seqlens_q"), options.get("cu_seqlens_k"),
        options.get("max_seqlen_q"), options.get("max_seqlen_k"), options.get("softmax_scale"),
        bool(options.get("causal", False)), None if window is None else [int(n) for n in window],
        float(options.get("softcap", 0.0)), bool(deterministic))
    return o


def _features(sink, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
              causal, window_size, softcap) -> dict:
    """flash_forward's keywords from the ops' arguments (detached tensors: DLPack refuses tensors
    that require grad, and detached views share the memory)."""
    named = dict(sink=sink, bias=bias, alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                 max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, window_size=window_size)
    features = {n: (x.detach() if isinstance(x, torch.Tensor) else x) for n, x in named.items() if x is not None}
    if softcap:
        features["softcap"] = softcap
    return dict(softmax_scale=softmax_scale, causal=causal, **features)


def _lse_shape(q, cu_seqlens_q):
    return (q.shape[1], q.shape[0]) if cu_seqlens_q is not None else (q.shape[0], q.shape[2], q.shape[1])


@torch.library.custom_op("cupy_flash::forward", mutates_args=(), device_types="cuda")
def _forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: Optional[torch.Tensor],
                bias: Optional[torch.Tensor], alibi_slopes: Optional[torch.Tensor], cu_seqlens_q: Optional[torch.Tensor],
                cu_seqlens_k: Optional[torch.Tensor], max_seqlen_q: Optional[int], max_seqlen_k: Optional[int],
                softmax_scale: Optional[float], causal: bool, window_size: Optional[list[int]], softcap: float,
                deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) of flash_forward (``deterministic`` is the backward's, kept for it)."""
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(_lse_shape(q, cu_seqlens_q), dtype=torch.float32, device=q.device)
    features = _features(sink, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         softmax_scale, causal, window_size, softcap)
    with _torch_memory(q.device):
        forward_into((o, lse), q.detach(), k.detach(), v.detach(), stream=torch.cuda.current_stream(q.device),
                     **features)
    return o, lse


@_forward_op.register_fake
def _(q, k, v, sink, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
      causal, window_size, softcap, deterministic):
    return q.new_empty(q.shape), q.new_empty(_lse_shape(q, cu_seqlens_q), dtype=torch.float32)


@torch.library.custom_op("cupy_flash::backward", mutates_args=(), device_types="cuda")
def _backward_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                 lse: torch.Tensor, sink: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                 alibi_slopes: Optional[torch.Tensor], cu_seqlens_q: Optional[torch.Tensor],
                 cu_seqlens_k: Optional[torch.Tensor], max_seqlen_q: Optional[int], max_seqlen_k: Optional[int],
                 softmax_scale: Optional[float], causal: bool, window_size: Optional[list[int]], softcap: float,
                 deterministic: bool, want_dbias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                 torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dsink, dbias) of flash_backward; dsink and dbias are empty where not asked for."""
    dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    features = _features(sink, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         softmax_scale, causal, window_size, softcap)
    with _torch_memory(q.device):
        grads = backward_into((dq, dk, dv), do.detach().contiguous(), q.detach(), k.detach(), v.detach(), o.detach(),
                              lse.detach(), stream=torch.cuda.current_stream(q.device), deterministic=deterministic,
                              return_dbias=want_dbias, **features)
        # dsink and dbias are CuPy arrays here over memory of PyTorch's (the allocator below):
        # copied into tensors of their own, as a custom op's outputs must not share memory.
        dsink = to_torch(grads[3]).clone() if sink is not None else q.new_empty(0, dtype=torch.float32)
        dbias = to_torch(grads[-1]).clone() if want_dbias else q.new_empty(0, dtype=torch.float32)
    return dq, dk, dv, dsink, dbias


@_backward_op.register_fake
def _(do, q, k, v, o, lse, sink, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      softmax_scale, causal, window_size, softcap, deterministic, want_dbias):
    dsink = sink.new_empty(sink.shape) if sink is not None else q.new_empty(0, dtype=torch.float32)
    dbias = bias.new_empty(bias.shape) if want_dbias else q.new_empty(0, dtype=torch.float32)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsink, dbias


def _setup_context(ctx, inputs, output):
    q, k, v, sink, bias, *rest = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], sink, bias, rest[0], rest[1], rest[2])
    ctx.static = rest[3:]   # max_seqlen_q/k, softmax_scale, causal, window_size, softcap, deterministic


def _backward(ctx, do, _dlse):
    # lse's gradient is not formed (flash_backward takes o's only); the forward's users get lse
    # from the op but flash_attn_func returns o alone.
    q, k, v, o, lse, sink, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size, softcap, deterministic = ctx.static
    want_dbias = bias is not None and ctx.needs_input_grad[4]
    dq, dk, dv, dsink, dbias = torch.ops.cupy_flash.backward(
        do, q, k, v, o, lse, sink, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        softmax_scale, causal, window_size, softcap, deterministic, want_dbias)
    return (dq, dk, dv, dsink if sink is not None else None, dbias if want_dbias else None) + (None,) * 10


_forward_op.register_autograd(_backward, setup_context=_setup_context)


@contextlib.contextmanager
def _torch_memory(device):
    """CuPy allocations inside (the kernels' temporaries) take memory from PyTorch's caching
    allocator on the current stream, so they follow its rules (CUDA-graph pools included)."""
    import cupy

    def allocate(size):
        block = torch.empty(max(int(size), 1), dtype=torch.uint8, device=device)
        memory = cupy.cuda.UnownedMemory(block.data_ptr(), block.numel(), block, block.device.index)
        return cupy.cuda.MemoryPointer(memory, 0)

    with cupy.cuda.using_allocator(allocate):
        yield
