"""PyTorch adapter (imported only when used): ``flash_attn_func`` with gradients through autograd.

    from cupy_flash.torch_adapter import flash_attn_func
    o = flash_attn_func(q, k, v, causal=True)      # q (batch, seqlen_q, heads_q, d), CUDA tensors
    o.sum().backward()                              # q.grad, k.grad, v.grad (and sink.grad, bias.grad)

Two routes to the same kernels:
- **Eager** calls go through a ``torch.autograd.Function`` (or no autograd node at all where no
  input requires grad), whose forward and backward launch the kernels on PyTorch's buffers.
- **Traced** calls (``torch.compile``, export, fake tensors) see the custom ops
  ``torch.ops.cupy_flash.forward`` and ``torch.ops.cupy_flash.backward``, each with a fake (meta)
  implementation giving its outputs' shapes, and the autograd formula registered on the forward.
  So ``torch.compile(fullgraph=True)`` traces a model that calls them without graph breaks, and
  CUDA graphs capture them.
The custom ops' dispatch costs ~20 us of host time a call (bench/host_overhead.py), which eager
calls do not pay.

A repeated plain call (no sink, bias, ALiBi, window, softcap or packed batch) finds its checked
launch plan by the tensors' shapes, strides, dtypes, alignment and device and launches on their
addresses: no DLPack, no CuPy arrays, no stream objects. Other calls (and the first of each kind)
take the tensors through DLPack without a copy and run flash_forward's checks; their temporaries
come from PyTorch's caching allocator (so a CUDA-graph capture keeps them in its private pool). The
outputs are PyTorch tensors the kernels write into, on PyTorch's current stream. Options are
flash_forward's: softmax_scale, causal, window_size, softcap, alibi_slopes, sink, bias,
cu_seqlens_q/k with max_seqlen_q/k, and the backward's deterministic. q, k, v, sink and bias may
require grad (bias gets its gradient reduced to its own shape).
"""

import contextlib
import math

import torch

from . import _launch, backward, forward
from ._checks import did_you_mean
from .backward import backward_into
from .forward import forward_into

_TENSOR_OPTIONS = ("alibi_slopes", "cu_seqlens_q", "cu_seqlens_k")
_STATIC_OPTIONS = ("max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal", "window_size", "softcap")
_OPTIONS = _TENSOR_OPTIONS + _STATIC_OPTIONS + ("deterministic",)
_OPTION_NAMES = frozenset(_OPTIONS)


def to_torch(array):
    """A torch tensor over a CuPy array's memory (bfloat16 through its bits: DLPack export of a
    bfloat16 CuPy array is not universal)."""
    if array.dtype.itemsize == 2 and array.dtype.kind == "V" or "bfloat16" in str(array.dtype):
        import cupy

        return torch.from_dlpack(array.view(cupy.uint16)).view(torch.bfloat16)
    return torch.from_dlpack(array)


def flash_attn_func(q, k, v, *, sink=None, bias=None, deterministic=False, **options):
    """Exact attention with gradients through PyTorch's autograd; options as flash_forward's.
    FP8: torch.float8_e4m3fn q, k, v with ``q_descale``, ``k_descale``, ``v_descale`` (FlashAttention-3's
    keywords; docs/fp8.md), eager or under torch.compile, without gradients; O bfloat16."""
    # A repeated plain call: its kept plan, before any option parsing (the checks below cost ~3.5 us
    # of host time; docs/performance.md, host time). Without a gradient to record, the launch alone;
    # with one, the kept plan's own autograd node (_KeptAttention).
    if (sink is None and bias is None and _SHORT_OPTIONS.issuperset(options) and type(q) is torch.Tensor
            and not torch.compiler.is_compiling()):
        softmax_scale, causal = options.get("softmax_scale"), bool(options.get("causal", False))
        if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
            o = _forward_short(q, k, v, softmax_scale, causal, want_lse=False)
            if o is not None:
                return o
        else:
            kept = _forward_plans.get(_forward_key(q, k, v, softmax_scale, causal))
            if kept is not None:
                return _KeptAttention.apply(q, k, v, kept, (softmax_scale, causal, bool(deterministic)))
    if q.dtype == torch.float8_e4m3fn or any(options.get(name) is not None for name in _FP8_DESCALES):
        return _forward_fp8(q, k, v, sink, bias, deterministic, options)
    options = {name: value for name, value in options.items() if name not in _FP8_DESCALES or value is not None}
    if not options.keys() <= _OPTION_NAMES:
        unknown = sorted(set(options) - _OPTION_NAMES)
        raise TypeError(f"flash_attn_func got unexpected option(s) {unknown}; it takes {sorted(_OPTIONS + ('sink', 'bias'))}"
                        + did_you_mean(unknown, _OPTIONS + ("sink", "bias")))
    window = options.get("window_size")
    tensors = (sink, bias, options.get("alibi_slopes"), options.get("cu_seqlens_q"), options.get("cu_seqlens_k"))
    static = (options.get("max_seqlen_q"), options.get("max_seqlen_k"), options.get("softmax_scale"),
              bool(options.get("causal", False)), None if window is None else [int(n) for n in window],
              float(options.get("softcap", 0.0)), bool(deterministic))
    if type(q) is not torch.Tensor or not q.is_cuda or torch.compiler.is_compiling():
        return torch.ops.cupy_flash.forward(q, k, v, *tensors, *static)[0]   # traced, or not CUDA: the op
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                    or any(x is not None and x.requires_grad for x in tensors[:2])):
        return _Attention.apply(q, k, v, *tensors, static)
    return _forward(q, k, v, *tensors, *static[:-1])[0]


_FP8_DESCALES = ("q_descale", "k_descale", "v_descale")
_SHORT_OPTIONS = frozenset(("softmax_scale", "causal"))   # the options a kept forward plan's key holds


def flash_attn_fp8_func(q, k, v, *, softmax_scale=None, causal=False, window_size=None, sink=None,
                        deterministic=False):
    """FP8 attention with gradients on float16 / bfloat16 / float32 CUDA tensors (Hopper): q, k, v
    are quantised to e4m3 inside, a descale per (batch, head) (quantize_fp8's bits, no
    synchronisation: an input holding inf or NaN gives inf or NaN), then the FP8 forward; O comes
    back in q's dtype. The backward gives the gradients of attention over the dequantised inputs
    (flash_backward's FP8 call), taken straight through the quantisation, in the inputs' dtypes;
    sink may require grad. Options as flash_forward's FP8 call (causal, window, sink, GQA / MQA).
    Eager or traced (torch.compile): the ops cupy_flash::fp8_attention and its backward."""
    window = None if window_size is None else [int(n) for n in window_size]
    o = torch.ops.cupy_flash.fp8_attention(q, k, v, sink, softmax_scale, bool(causal), window, bool(deterministic))[0]
    return o if o.dtype == q.dtype else o.to(q.dtype)


def _forward_fp8(q, k, v, sink, bias, deterministic, options):
    """flash_attn_func's FP8 call. Eager: flash_forward on the framework's stream, its O handed over
    by DLPack (no copy). Traced (torch.compile): the op cupy_flash::forward_fp8, descales as tensors
    (CUDA ones; CPU ones go up as host descales). Refused where a gradient is wanted: autograd would
    round a float8 input's gradient to e4m3 (flash_backward takes FP8 inputs: the gradients of the
    dequantised inputs, in bfloat16)."""
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v) if isinstance(x, torch.Tensor)):
        raise NotImplementedError("flash_attn_func: FP8 inputs take no gradient here (autograd would round a float8 "
                                  "input's gradient to e4m3); cupy_flash.flash_backward takes FP8 inputs")
    if deterministic:
        raise ValueError("deterministic applies to the backward; FP8 calls of flash_attn_func have none")
    if torch.compiler.is_compiling():
        unknown = sorted(set(options) - set(_FP8_DESCALES) - _FP8_OP_OPTIONS)
        if bias is not None or unknown:
            raise TypeError(f"flash_attn_func (FP8, traced) got unexpected option(s) {unknown or ['bias']}; it takes "
                            f"{sorted(_FP8_OP_OPTIONS | set(_FP8_DESCALES) | {'sink'})}")
        window = options.get("window_size")
        return torch.ops.cupy_flash.forward_fp8(
            q, k, v, *(options.get(name) for name in _FP8_DESCALES), sink, options.get("cu_seqlens_q"),
            options.get("cu_seqlens_k"), options.get("max_seqlen_q"), options.get("max_seqlen_k"),
            options.get("softmax_scale"), bool(options.get("causal", False)),
            None if window is None else [int(n) for n in window])[0]
    device = q.device if isinstance(q, torch.Tensor) else None
    given = {name: value for name, value in dict(options, sink=sink, bias=bias).items() if value is not None}
    o, _ = forward.flash_forward(q, k, v, stream=torch.cuda.current_stream(device), **given)
    return torch.from_dlpack(o)


_FP8_OP_OPTIONS = frozenset(("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal",
                             "window_size"))


class _Attention(torch.autograd.Function):
    """Eager calls' autograd node: the custom ops' forward and backward without their dispatch."""

    @staticmethod
    def forward(ctx, q, k, v, sink, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, static):
        o, lse = _forward(q, k, v, sink, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, *static[:-1])
        ctx.save_for_backward(q, k, v, o, lse, sink, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k)
        ctx.static = static   # max_seqlen_q/k, softmax_scale, causal, window_size, softcap, deterministic
        return o

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        q, k, v, o, lse, sink, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
        want_dbias = bias is not None and ctx.needs_input_grad[4]
        dq, dk, dv, dsink, dbias = _backward(do, q, k, v, o, lse, sink, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                                             *ctx.static, want_dbias)
        return (dq, dk, dv, dsink if sink is not None else None, dbias if want_dbias else None) + (None,) * 4


class _KeptAttention(torch.autograd.Function):
    """A repeated plain call's autograd node: the forward's kept plan (flash_attn_func found it by
    the tensors) and the backward's, kept beside it by the first backward (``_Kept.backward``);
    five saved tensors, where _Attention saves ten and its call parses the options first."""

    @staticmethod
    def forward(ctx, q, k, v, kept, static):
        softmax_scale, causal, _deterministic = static
        outputs = _forward_kept(kept, q, k, v)
        if outputs is None:   # another current device, a capturing stream: the checked route
            outputs = _forward(q, k, v, *_NO_TENSORS, None, None, softmax_scale, causal, None, 0.0)
        o, lse = outputs
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.kept, ctx.static = kept, static
        return o

    @staticmethod
    def backward(ctx, do):
        if torch.is_grad_enabled():   # create_graph=True: no gradients of gradients (once_differentiable)
            return _kept_backward_once(ctx, do)
        return _kept_backward(ctx, do)


_NO_TENSORS = (None,) * 5   # sink, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k


def _kept_backward(ctx, do):
    """_KeptAttention's gradients: the backward plan kept beside the forward's (do, o and lse are
    then as the first backward's: autograd gives do o's shape, dtype and device, contiguous() its
    strides, and the forward made o and lse contiguous; only do's alignment is asked), else the
    checked route, which keeps it."""
    q, k, v, o, lse = ctx.saved_tensors
    softmax_scale, causal, deterministic = ctx.static
    do = do.contiguous()
    aligned = not do.data_ptr() & 15
    key = (deterministic, forward.families.kernels_setting())
    backward_kept = ctx.kept.backward.get(key) if aligned else None
    if backward_kept is not None:
        grads = _backward_kept(backward_kept, do, q, k, v, o, lse)
        if grads is not None:
            return grads + (None, None)
    dq, dk, dv, _, _ = _backward(do, q, k, v, o, lse, *_NO_TENSORS, None, None, softmax_scale, causal, None, 0.0,
                                 deterministic, False)
    if aligned and o.is_contiguous() and lse.is_contiguous():
        backward_kept = _backward_plans.get(_backward_key(do, q, k, v, o, lse, softmax_scale, causal, deterministic))
        if backward_kept is not None:
            ctx.kept.backward[key] = backward_kept
    return dq, dk, dv, None, None


_kept_backward_once = torch.autograd.function.once_differentiable(_kept_backward)


# -------------------------------------------------------------------------------------------------
# The implementations both routes share.

def _forward(q, k, v, sink, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
             causal, window_size, softcap):
    """(o, lse) of flash_forward on tensors: a repeated plain call through its plan, else checked."""
    plain = _plain(sink, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window_size, softcap)
    if plain:
        outputs = _forward_short(q, k, v, softmax_scale, causal)
        if outputs is not None:
            return outputs
    o = torch.empty(_o_shape(q, v), dtype=q.dtype, device=q.device)
    lse = torch.empty(_lse_shape(q, cu_seqlens_q), dtype=torch.float32, device=q.device)
    features = _features(sink, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                         causal, window_size, softcap)
    with _torch_memory(q.device), _on_torch_stream(q):
        views = _views(("q", "k", "v"), (q, k, v))
        forward_into((o, lse), *views, **features)
        if plain:   # the plan flash_forward kept for these views, found from now on by the tensors
            plan = forward._plans.get(forward._plan_key(*views, softmax_scale, causal))
            if plan is not None:
                _launch.kept(_forward_plans, _forward_key(q, k, v, softmax_scale, causal), _Kept(plan, (q, k, v)))
    return o, lse


def _forward_short(q, k, v, softmax_scale, causal, want_lse: bool = True):
    """(o, lse) of a repeated plain call through its kept plan (without ``want_lse``, o alone: lse
    goes to the stream's kept workspace, as no one reads it), or None (not kept, or the plan cannot
    launch as it is: another current device, a capturing stream)."""
    if type(q) is not torch.Tensor:   # a traced or subclassed tensor: the op
        return None
    kept = _forward_plans.get(_forward_key(q, k, v, softmax_scale, causal))
    return None if kept is None else _forward_kept(kept, q, k, v, want_lse)


def _forward_kept(kept, q, k, v, want_lse: bool = True):
    """_forward_short's launch on a kept plan found for q, k, v."""
    plan = kept.plan
    stream = _launch.ready_stream(plan, _raw_stream(plan.device))
    if stream is None:
        return None
    o = kept.new_o(q)
    if want_lse:
        lse = q.new_empty(plan.lse_shape, dtype=torch.float32)
        lse_at = lse.data_ptr()
    else:   # the stream's kept workspace (a torch.empty costs ~2.7 us), or past its bound a tensor
        lse_at, _held = _launch.short_call_workspace(kept.lse_bytes, plan.device, stream,
                                                     lambda nbytes: q.new_empty(nbytes, dtype=torch.uint8))
    plan.launch((q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse_at), stream, False)
    return (o, lse) if want_lse else o


def _backward(do, q, k, v, o, lse, sink, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              softmax_scale, causal, window_size, softcap, deterministic, want_dbias):
    """(dq, dk, dv, dsink, dbias) of flash_backward on tensors; dsink and dbias are None where not
    asked for. A repeated plain call through its plan, else checked."""
    do = do.contiguous()   # an expanded gradient (o.sum()'s) is read once, here, rather than copied per view
    plain = _plain(sink, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window_size, softcap)
    if plain:
        key = _backward_key(do, q, k, v, o, lse, softmax_scale, causal, deterministic)
        kept = _backward_plans.get(key)
        grads = None if kept is None else _backward_kept(kept, do, q, k, v, o, lse)
        if grads is not None:
            return grads + (None, None)
    dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    features = _features(sink, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         softmax_scale, causal, window_size, softcap)
    with _torch_memory(q.device), _on_torch_stream(q):
        views = _views(("do", "q", "k", "v", "o", "lse"), (do, q, k, v, o, lse))
        grads = backward_into((dq, dk, dv), *views, deterministic=deterministic, return_dbias=want_dbias, **features)
        # dsink and dbias are CuPy arrays here over memory of PyTorch's (the allocator below):
        # copied into tensors of their own, as a custom op's outputs must not share memory.
        dsink = to_torch(grads[3]).clone() if sink is not None else None
        dbias = to_torch(grads[-1]).clone() if want_dbias else None
        if plain:
            plan = backward._plans.get(backward._plan_key(*views, softmax_scale, causal, deterministic))
            if plan is not None:
                _launch.kept(_backward_plans, key, _Kept(plan, (q, k, v)))
    return dq, dk, dv, dsink, dbias


def _backward_kept(kept, do, q, k, v, o, lse):
    """(dq, dk, dv) of a repeated plain backward through its kept plan, or None (the plan cannot
    launch as it is: another current device, a capturing stream)."""
    plan = kept.plan
    stream = _launch.ready_stream(plan, _raw_stream(plan.device))
    if stream is None:
        return None
    # Large: PyTorch's, on this stream
    workspace, _owner = plan.workspace_on(stream, lambda nbytes: q.new_empty(nbytes, dtype=torch.uint8))
    first = plan.launch_first((do.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr()),
                              workspace, stream, False)
    new = kept.new
    dq, dk, dv = new(q), new(k), new(v)
    plan.launch_rest(first + (dq.data_ptr(), dk.data_ptr(), dv.data_ptr()), stream, False)
    return dq, dk, dv


def _plain(sink, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window_size, softcap):
    """Whether a call has none of the options a plan's key leaves out (it may take the short path)."""
    return (sink is None and bias is None and alibi_slopes is None and cu_seqlens_q is None and cu_seqlens_k is None
            and max_seqlen_q is None and max_seqlen_k is None and window_size is None and not softcap)


class _Kept:
    """A kept plan with how the short path makes o (and dq, dk, dv): ``new(x)``, a new tensor of x's
    shape and dtype, C-contiguous: ``torch.empty_like`` where the planned q, k, v are contiguous
    (1.9 us against ``new_empty``'s 2.75 on the H100's host, interleaved)."""

    __slots__ = ("plan", "new", "new_o", "lse_bytes", "backward")

    def __init__(self, plan, inputs: tuple):
        self.plan = plan
        # A forward's: the backward's _Kept for its outputs, by (deterministic, kernels setting)
        # (_KeptAttention's backward)
        self.backward = {}
        self.new = torch.empty_like if all(x.is_contiguous() for x in inputs) else _new_contiguous
        # o: q's shape with v's head_dim (a forward plan's o_shape)
        o_shape = getattr(plan, "o_shape", None)
        self.new_o = self.new if o_shape is None or o_shape == tuple(inputs[0].shape) else (
            lambda q: q.new_empty(o_shape))
        lse_shape = getattr(plan, "lse_shape", None)   # a forward plan's lse (float32)
        self.lse_bytes = 0 if lse_shape is None else 4 * math.prod(lse_shape)


def _new_contiguous(x):
    return x.new_empty(x.shape)


# Plans of plain calls by what the checks read of the tensors (shapes, strides, dtypes, the
# addresses' alignment, devices) and the options with their types: the plan flash_forward (or
# flash_backward) kept for the same call on CuPy views of them, which reads them in place (_Kept).
_forward_plans: dict = {}
_backward_plans: dict = {}


def _forward_key(q, k, v, softmax_scale, causal):
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
            (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15, q.get_device(), k.get_device(), v.get_device(),
            type(softmax_scale), softmax_scale, causal, forward.families.kernels_setting())


def _backward_key(do, q, k, v, o, lse, softmax_scale, causal, deterministic):
    return _forward_key(q, k, v, softmax_scale, causal) + (
        do.shape, do.stride(), do.dtype, o.shape, o.stride(), o.dtype, lse.shape, lse.stride(), lse.dtype,
        (do.data_ptr() | o.data_ptr()) & 15, do.get_device(), o.get_device(), lse.get_device(), deterministic)


def _raw_stream(device: int) -> int:
    return torch.cuda.current_stream(device).cuda_stream


if hasattr(torch._C, "_cuda_getCurrentRawStream"):   # PyTorch's own fast accessor (what Inductor's code calls)
    _raw_stream = torch._C._cuda_getCurrentRawStream  # noqa: F811


@contextlib.contextmanager
def _on_torch_stream(q):
    """q's device and PyTorch's current stream there, current for CuPy inside: DLPack hands the
    tensors over on it (no wait between streams, which a capturing stream would refuse) and the
    kernels launch on it."""
    import cupy

    from ._streams import as_cupy_stream

    device = q.get_device()
    pointer = _raw_stream(device)
    with cupy.cuda.Device(device):
        stream = _cupy_streams.get(pointer)
        if stream is None:
            stream = _launch.kept(_cupy_streams, pointer, as_cupy_stream(pointer))
        with stream:
            yield


_cupy_streams: dict = {}   # CuPy's objects for PyTorch's streams, by pointer


def _views(names: tuple, tensors: tuple) -> tuple:
    """CuPy views (DLPack, no copy) of tensors: detached, as DLPack refuses tensors that require grad."""
    from ._checks import as_gpu_array

    return tuple(as_gpu_array(name, x.detach()) for name, x in zip(names, tensors))


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


def _o_shape(q, v):
    """o's shape: q's, with v's head_dim."""
    return tuple(q.shape[:-1]) + (v.shape[-1],)


def _lse_shape(q, cu_seqlens_q):
    return (q.shape[1], q.shape[0]) if cu_seqlens_q is not None else (q.shape[0], q.shape[2], q.shape[1])


# -------------------------------------------------------------------------------------------------
# The custom ops: what torch.compile, export and fake tensors see. Defined through torch.library's
# Library (schema, CUDA kernel, fake kernel, autograd formula): torch.library.custom_op's wrapper
# (aliasing checks, a dynamo-disabled frame) doubled a call's dispatch (bench/host_overhead.py).

_LIBRARY = torch.library.Library("cupy_flash", "DEF")
_OPTIONAL_ARGUMENTS = ("Tensor? sink, Tensor? bias, Tensor? alibi_slopes, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, "
                       "int? max_seqlen_q, int? max_seqlen_k, float? softmax_scale, bool causal, int[]? window_size, "
                       "float softcap, bool deterministic")
_LIBRARY.define(f"forward(Tensor q, Tensor k, Tensor v, {_OPTIONAL_ARGUMENTS}) -> (Tensor, Tensor)")
_LIBRARY.define(f"backward(Tensor do, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, {_OPTIONAL_ARGUMENTS}, "
                "bool want_dbias) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")


def _forward_kernel(q, k, v, sink, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    softmax_scale, causal, window_size, softcap, deterministic):
    """cupy_flash::forward: (o, lse) of flash_forward (``deterministic`` is the backward's, kept for it)."""
    return _forward(q, k, v, sink, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    softmax_scale, causal, window_size, softcap)


def _backward_kernel(do, q, k, v, o, lse, sink, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, softmax_scale, causal, window_size, softcap, deterministic, want_dbias):
    """cupy_flash::backward: (dq, dk, dv, dsink, dbias) of flash_backward; dsink and dbias are empty
    where not asked for (an op's outputs are tensors of their own)."""
    dq, dk, dv, dsink, dbias = _backward(do, q, k, v, o, lse, sink, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                                         max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size, softcap,
                                         deterministic, want_dbias)
    return (dq, dk, dv, q.new_empty(0, dtype=torch.float32) if dsink is None else dsink,
            q.new_empty(0, dtype=torch.float32) if dbias is None else dbias)


_LIBRARY.impl("forward", _forward_kernel, "CUDA")
_LIBRARY.impl("backward", _backward_kernel, "CUDA")

# The FP8 forward (no autograd formula: flash_attn_func refuses FP8 inputs that want a gradient).
_LIBRARY.define("forward_fp8(Tensor q, Tensor k, Tensor v, Tensor q_descale, Tensor k_descale, Tensor v_descale, "
                "Tensor? sink, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, int? max_seqlen_q, int? max_seqlen_k, "
                "float? softmax_scale, bool causal, int[]? window_size) -> (Tensor, Tensor)")


def _forward_fp8_kernel(q, k, v, q_descale, k_descale, v_descale, sink, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                        max_seqlen_k, softmax_scale, causal, window_size):
    """cupy_flash::forward_fp8: (o bfloat16, lse) of flash_forward on float8_e4m3fn q, k, v; CPU
    descales are host descales (NumPy views), CUDA ones GPU descales."""
    o = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(_lse_shape(q, cu_seqlens_q), dtype=torch.float32, device=q.device)
    descales = {name: (x.numpy() if x.device.type == "cpu" else x.detach())
                for name, x in zip(_FP8_DESCALES, (q_descale, k_descale, v_descale))}
    features = _features(sink, None, None, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                         window_size, 0.0)
    with _torch_memory(q.device), _on_torch_stream(q):
        forward_into((o, lse), q.detach(), k.detach(), v.detach(), **features, **descales)
    return o, lse


_LIBRARY.impl("forward_fp8", _forward_fp8_kernel, "CUDA")

# flash_attn_fp8_func: quantisation and the FP8 forward, then its backward (autograd formula below).
_FP8_OPTIONS = "Tensor? sink, float? softmax_scale, bool causal, int[]? window_size, bool deterministic"
_LIBRARY.define(f"fp8_attention(Tensor q, Tensor k, Tensor v, {_FP8_OPTIONS}) -> (Tensor, Tensor, Tensor, Tensor, "
                "Tensor, Tensor, Tensor, Tensor)")
_LIBRARY.define("fp8_attention_backward(Tensor do, Tensor q8, Tensor k8, Tensor v8, Tensor q_descale, Tensor k_descale, "
                f"Tensor v_descale, Tensor o, Tensor lse, {_FP8_OPTIONS}) -> (Tensor, Tensor, Tensor, Tensor)")


def _fp8_features(sink, softmax_scale, causal, window_size) -> dict:
    return _features(sink, None, None, None, None, None, None, softmax_scale, causal, window_size, 0.0)


def _fp8_attention_kernel(q, k, v, sink, softmax_scale, causal, window_size, deterministic):
    """cupy_flash::fp8_attention: (o bfloat16, lse, q8, k8, v8 (uint8 e4m3 bits), q, k, v descales)."""
    from . import fp8
    from ._checks import kernel_ready
    from .families import rows

    if q.get_device() < 0 or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"flash_attn_fp8_func takes float16, bfloat16 or float32 CUDA tensors; q is {q.dtype} on {q.device}")
    o = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(_lse_shape(q, None), dtype=torch.float32, device=q.device)
    with _torch_memory(q.device), _on_torch_stream(q), fp8.trusted_descales():
        views = _views(("q", "k", "v"), (q, k, v))
        for name, x in zip(("q", "k", "v"), views):
            if x.ndim != 4 or x.shape[3] % 16:
                raise ValueError(f"flash_attn_fp8_func: {name} must be (batch, seqlen, heads, head_dim) with head_dim a "
                                 f"multiple of 16, got shape {tuple(x.shape)}")
        quantised = [rows.quantize_e4m3(kernel_ready(x)) for x in views]
        descales = {name: descale for name, (_, descale) in zip(_FP8_DESCALES, quantised)}
        forward_into((o, lse), *(bits for bits, _ in quantised), **_fp8_features(sink, softmax_scale, causal, window_size),
                     **descales)
    return (o, lse) + tuple(to_torch(bits) for bits, _ in quantised) + tuple(to_torch(d) for _, d in quantised)


def _fp8_attention_backward_kernel(do, q8, k8, v8, q_descale, k_descale, v_descale, o, lse, sink, softmax_scale,
                                   causal, window_size, deterministic):
    """cupy_flash::fp8_attention_backward: (dq, dk, dv bfloat16, dsink float32 or empty)."""
    from . import fp8

    grads = tuple(torch.empty(x.shape, dtype=torch.bfloat16, device=x.device) for x in (q8, k8, v8))
    do = do.to(torch.bfloat16).contiguous()
    with _torch_memory(q8.device), _on_torch_stream(q8), fp8.trusted_descales():
        views = _views(("do", "q", "k", "v", "o", "lse", *_FP8_DESCALES),
                       (do, q8, k8, v8, o, lse, q_descale, k_descale, v_descale))
        descales = dict(zip(_FP8_DESCALES, views[6:]))
        result = backward_into(grads, *views[:6], deterministic=deterministic,
                               **_fp8_features(sink, softmax_scale, causal, window_size), **descales)
        dsink = to_torch(result[3]).clone() if sink is not None else q8.new_empty(0, dtype=torch.float32)
    return grads + (dsink,)


_LIBRARY.impl("fp8_attention", _fp8_attention_kernel, "CUDA")
_LIBRARY.impl("fp8_attention_backward", _fp8_attention_backward_kernel, "CUDA")


@torch.library.register_fake("cupy_flash::fp8_attention", lib=_LIBRARY)
def _(q, k, v, sink, softmax_scale, causal, window_size, deterministic):
    bits = tuple(x.new_empty(x.shape, dtype=torch.uint8) for x in (q, k, v))
    descales = tuple(x.new_empty((x.shape[0], x.shape[2]), dtype=torch.float32) for x in (q, k, v))
    return (q.new_empty(q.shape, dtype=torch.bfloat16), q.new_empty(_lse_shape(q, None), dtype=torch.float32)) + bits + descales


@torch.library.register_fake("cupy_flash::fp8_attention_backward", lib=_LIBRARY)
def _(do, q8, k8, v8, q_descale, k_descale, v_descale, o, lse, sink, softmax_scale, causal, window_size, deterministic):
    dsink = sink.new_empty(sink.shape) if sink is not None else q8.new_empty(0, dtype=torch.float32)
    return tuple(x.new_empty(x.shape, dtype=torch.bfloat16) for x in (q8, k8, v8)) + (dsink,)


def _fp8_setup_context(ctx, inputs, output):
    q, k, v, sink, *static = inputs
    ctx.save_for_backward(*output[2:], output[0], output[1], sink)   # q8, k8, v8, descales, o, lse, sink
    ctx.static = static   # softmax_scale, causal, window_size, deterministic
    ctx.dtypes = (q.dtype, k.dtype, v.dtype)


def _fp8_backward_formula(ctx, do, *_unused):
    q8, k8, v8, q_descale, k_descale, v_descale, o, lse, sink = ctx.saved_tensors
    dq, dk, dv, dsink = torch.ops.cupy_flash.fp8_attention_backward(do, q8, k8, v8, q_descale, k_descale, v_descale, o,
                                                                     lse, sink, *ctx.static)
    grads = tuple(g if g.dtype == dtype else g.to(dtype) for g, dtype in zip((dq, dk, dv), ctx.dtypes))
    return grads + (dsink if sink is not None else None,) + (None,) * 4


torch.library.register_autograd("cupy_flash::fp8_attention", _fp8_backward_formula, setup_context=_fp8_setup_context,
                                lib=_LIBRARY)


@torch.library.register_fake("cupy_flash::forward_fp8", lib=_LIBRARY)
def _(q, k, v, q_descale, k_descale, v_descale, sink, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      softmax_scale, causal, window_size):
    return q.new_empty(q.shape, dtype=torch.bfloat16), q.new_empty(_lse_shape(q, cu_seqlens_q), dtype=torch.float32)


@torch.library.register_fake("cupy_flash::forward", lib=_LIBRARY)
def _(q, k, v, sink, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
      causal, window_size, softcap, deterministic):
    return q.new_empty(_o_shape(q, v)), q.new_empty(_lse_shape(q, cu_seqlens_q), dtype=torch.float32)


@torch.library.register_fake("cupy_flash::backward", lib=_LIBRARY)
def _(do, q, k, v, o, lse, sink, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      softmax_scale, causal, window_size, softcap, deterministic, want_dbias):
    dsink = sink.new_empty(sink.shape) if sink is not None else q.new_empty(0, dtype=torch.float32)
    dbias = bias.new_empty(bias.shape) if want_dbias else q.new_empty(0, dtype=torch.float32)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsink, dbias


def _setup_context(ctx, inputs, output):
    q, k, v, sink, bias, *rest = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], sink, bias, rest[0], rest[1], rest[2])
    ctx.static = rest[3:]   # max_seqlen_q/k, softmax_scale, causal, window_size, softcap, deterministic


def _backward_formula(ctx, do, _dlse):
    # lse's gradient is not formed (flash_backward takes o's only); the forward's users get lse
    # from the op but flash_attn_func returns o alone.
    q, k, v, o, lse, sink, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size, softcap, deterministic = ctx.static
    want_dbias = bias is not None and ctx.needs_input_grad[4]
    dq, dk, dv, dsink, dbias = torch.ops.cupy_flash.backward(
        do, q, k, v, o, lse, sink, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
        max_seqlen_k, softmax_scale, causal, window_size, softcap, deterministic, want_dbias)
    return (dq, dk, dv, dsink if sink is not None else None, dbias if want_dbias else None) + (None,) * 10


torch.library.register_autograd("cupy_flash::forward", _backward_formula, setup_context=_setup_context, lib=_LIBRARY)


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


# -------------------------------------------------------------------------------------------------
# Decoding against a K/V cache: FlashAttention-2's flash_attn_with_kvcache.

def get_mla_metadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, *args, **kwargs):
    """FlashMLA's scheduling call, for code written against FlashMLA: flash_mla_with_kvcache needs no
    metadata (its plan chooses the splits), so this returns (None, None)."""
    return None, None


def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata=None,
                           num_splits=None, softmax_scale=None, causal=False):
    """FlashMLA's ``flash_mla_with_kvcache`` on flash_decode's MLA kernel: q (batch, seqlen_q, heads,
    576), k_cache the paged latent cache (pages, page_size, 1, 576) with block_table (batch, pages per
    sequence) int32 and cache_seqlens (batch,) int32, v the first ``head_dim_v`` columns of each row.
    tile_scheduler_metadata and num_splits (get_mla_metadata's) are taken and not needed. Returns
    (out, lse) as FlashMLA: out (batch, seqlen_q, heads, head_dim_v) in q's dtype, lse float32
    (batch, heads, seqlen_q). Inference: no gradient; on PyTorch's current stream."""
    from .decode import check_latent_v

    head_dim_v = check_latent_v(k_cache, None, None, head_dim_v)
    return flash_attn_with_kvcache(q, k_cache, k_cache[..., :head_dim_v], cache_seqlens=cache_seqlens,
                                   block_table=block_table, softmax_scale=softmax_scale, causal=causal,
                                   return_softmax_lse=True)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                            cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None,
                            num_splits=0, return_softmax_lse=False, *, k_descale=None, v_descale=None, sink=None):
    """cupy_flash.flash_decode on PyTorch tensors with FlashAttention-2's ``flash_attn_with_kvcache``
    signature and defaults (``rotary_interleaved=True``, ``num_splits=0``: chosen): k and v (the new
    tokens) are written into k_cache / v_cache in place at cache_seqlens[b], rotated first where
    rotary_cos / rotary_sin are given; cache_seqlens an int or an int32 (batch,) tensor. Also an FP8
    cache (torch.float8_e4m3fn k_cache / v_cache with float32 ``k_descale`` / ``v_descale``) and a
    ``sink``. Returns out like q (v's head_dim), and its lse (batch, heads, seqlen_q) with
    ``return_softmax_lse``. Inference: no gradient. On PyTorch's current stream; outputs and
    temporaries from its caching allocator (CUDA graphs capture the call)."""
    from .decode import flash_decode

    if cache_seqlens is None:
        raise ValueError("cache_seqlens is missing: the keys already in each sequence's cache (an int, or an int32 "
                         "(batch,) tensor)")
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32, device=q.device)
    o = torch.empty(tuple(q.shape[:-1]) + (v_cache.shape[-1],), dtype=q.dtype, device=q.device)
    lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32, device=q.device)
    tensors = dict(cache_seqlens=cache_seqlens, k_new=k, v_new=v, block_table=block_table,
                   cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, rotary_cos=rotary_cos,
                   rotary_sin=rotary_sin, k_descale=k_descale, v_descale=v_descale, alibi_slopes=alibi_slopes,
                   sink=sink)
    with torch.no_grad(), _torch_memory(q.device), _on_torch_stream(q):
        named = {name: x for name, x in tensors.items() if x is not None}
        views = dict(zip(named, _views(tuple(named), tuple(named.values()))))
        q_view, k_view, v_view = _views(("q", "k_cache", "v_cache"), (q, k_cache, v_cache))
        out, out_lse = flash_decode(q_view, k_view, v_view, softmax_scale=softmax_scale, causal=causal,
                                    window_size=window_size, softcap=softcap, rotary_interleaved=rotary_interleaved,
                                    num_splits=num_splits or None, **views)
        o_view, lse_view = _views(("o", "lse"), (o, lse))
        bits = "u2" if out.dtype.itemsize == 2 else out.dtype   # 16-bit values copied as their bits
        o_view.view(bits)[...] = out.view(bits)
        lse_view[...] = out_lse
    return (o, lse) if return_softmax_lse else o
