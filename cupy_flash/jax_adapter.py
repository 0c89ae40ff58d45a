"""JAX adapter (imported only when used): ``flash_attention`` on JAX arrays, under ``jax.jit``,
``jax.grad`` and ``jax.vmap``.

    import jax
    from cupy_flash.jax_adapter import flash_attention

    @jax.jit
    def loss(q, k, v):
        return flash_attention(q, k, v, causal=True).astype(jax.numpy.float32).sum()

    dq, dk, dv = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)   # q (batch, seqlen_q, heads_q, d) on a GPU

The kernels are foreign GPU code inside XLA's program: an XLA FFI custom call whose handler is a
Python function (``_xla_ffi``: a ctypes callback, nothing built). At each execution XLA calls it
with its own buffers and the CUDA stream it runs on, and the kernels launch there, writing o, lse
(forward) and dq, dk, dv (backward) straight into the buffers XLA allocated for them. No copy, no
host synchronisation. The handler runs on every execution, so the launch cost of a call (a few
microseconds of Python once its plan is kept) is paid each time, as in eager use; XLA's command
buffers are not used for it.

The gradient is a ``jax.custom_vjp``: the forward keeps o and lse, the backward runs
flash_backward. ``jax.vmap`` folds the mapped axes into the batch (one launch; an operand that is not mapped is
broadcast by XLA first, a copy). Temporaries (the
backward's float32 dQ accumulator, row statistics) come from CuPy's memory pool on XLA's stream:
leave the GPU memory XLA does not use to CuPy, e.g. ``XLA_PYTHON_CLIENT_MEM_FRACTION=0.6`` or
``XLA_PYTHON_CLIENT_PREALLOCATE=false``, since XLA preallocates 75% by default.

Options are flash_forward's: ``softmax_scale``, ``causal``, ``window_size``, ``softcap``, and
``deterministic`` (the backward's). They are static (Python values); the others (alibi_slopes,
sink, bias, packed batches) are not offered here, and asking for them is a TypeError naming them
(``ring_attention`` takes a sink).
Argument errors are flash_forward's own, raised when the call is traced, before anything runs.
"""

from __future__ import annotations

import functools

import jax
import numpy

from . import _checks, _launch, backward, forward
from ._launch import kept
from ._xla_ffi import python_call
from .backward import backward_into
from .forward import forward_into


def flash_attention(q, k, v, **options):
    """Exact attention ``softmax(softmax_scale * q k^T) v`` on JAX arrays, differentiable in q, k
    and v; q (batch, seqlen_q, heads_q, head_dim), k and v (batch, seqlen_k, heads_kv, head_dim),
    float16, bfloat16 or float32 on a CUDA GPU (v's head_dim may differ). Returns o like q with v's
    head_dim. FP8 inputs: flash_forward's."""
    return flash_forward(q, k, v, **options)[0]


def flash_forward(q, k, v, **options):
    """(o, lse) as cupy_flash.flash_forward gives them, on JAX arrays; differentiable in q, k, v
    through o. lse comes under ``jax.lax.stop_gradient``: the backward takes o's cotangent only
    (as flash_backward does), so a loss that uses lse gets no gradient through it.

    FP8 (Hopper): jnp.float8_e4m3fn (or uint8 bits) q, k, v with ``q_descale``, ``k_descale``,
    ``v_descale`` as JAX arrays: the FP8 forward, o bfloat16, inference only (no gradient). Under
    jit the descales' values are not read back to check them (fp8.trusted_descales)."""
    if any(name in options for name in _DESCALES) or q.dtype == jax.numpy.float8_e4m3fn:
        return _fp8_inference(q, k, v, dict(options))
    o, lse = _attention(_checks.check_traced_call("flash_attention (JAX)", q, k, v, options))(q, k, v)
    return o, jax.lax.stop_gradient(lse)


_DESCALES = ("q_descale", "k_descale", "v_descale")
_FP8_INFERENCE_OPTIONS = ("softmax_scale", "causal", "window_size")


def _fp8_inference(q, k, v, options: dict) -> tuple:
    """flash_forward's FP8 call on JAX arrays: checked while tracing (shapes, dtypes, options), then
    a custom call running the FP8 forward on XLA's buffers."""
    descales = {name: options.pop(name, None) for name in _DESCALES}
    unknown = sorted(set(options) - set(_FP8_INFERENCE_OPTIONS))
    if unknown:
        raise TypeError(f"flash_attention (JAX, FP8) got unsupported option(s) {unknown}; it takes "
                        f"{list(_FP8_INFERENCE_OPTIONS) + list(_DESCALES)}")
    bits = []
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype == jax.numpy.float8_e4m3fn:
            x = jax.lax.bitcast_convert_type(x, jax.numpy.uint8)
        elif x.dtype != jax.numpy.uint8:
            raise TypeError(f"{name} has dtype {x.dtype} but FP8 calls take q, k and v all in float8_e4m3fn (or uint8 bits)")
        bits.append(x)
    shape = _checks.check_qkv(*(_checks._Described(x) for x in bits), fp8=True)
    for name, descale in descales.items():
        if descale is None:
            raise ValueError(f"{name} is missing: FP8 inputs need q_descale, k_descale and v_descale")
        shapes = [(shape.batch, shape.heads_kv)] + ([(shape.batch, shape.heads)] if name == "q_descale" else [])
        if tuple(descale.shape) not in shapes or not jax.numpy.issubdtype(descale.dtype, jax.numpy.floating):
            raise ValueError(f"{name} has shape {tuple(descale.shape)} and dtype {descale.dtype}; expected float "
                             f"{' or '.join(str(s) for s in shapes)} (batch, heads)")
    scale = _checks.check_softmax_scale(options.get("softmax_scale"), shape.head_dim)
    causal = _checks.check_flag("causal", options.get("causal", False))
    window = options.get("window_size")
    static = (("softmax_scale", float(scale)), ("causal", causal),
              ("window_size", None if window is None else tuple(int(n) for n in window)))
    results = (jax.ShapeDtypeStruct(q.shape, jax.numpy.bfloat16),
               jax.ShapeDtypeStruct((shape.batch, shape.heads, shape.seqlen_q), numpy.float32))
    scales = tuple(descales[name].astype(jax.numpy.float32) for name in _DESCALES)
    o, lse = python_call(functools.partial(_fp8_inference_callback, static), results)(*bits, *scales)
    return o, jax.lax.stop_gradient(lse)


def _fp8_inference_callback(static, call):
    from . import fp8

    options = {name: value for name, value in static if value is not None}
    (o, lse), (q8, k8, v8, q_descale, k_descale, v_descale) = call.outputs_described(), call.inputs_described()
    with _on_xla_stream(call), fp8.trusted_descales():
        forward_into((_as_cupy(o), _as_cupy(lse)), *(_as_cupy(x) for x in (q8, k8, v8)), **options,
                     **{name: _as_cupy(d) for name, d in zip(_DESCALES, (q_descale, k_descale, v_descale))})


@functools.lru_cache(maxsize=256)
def _calls(static: tuple) -> tuple:
    """(forward_call, backward_call) for one set of options: q, k, v -> (o, lse) and do, q, k, v, o,
    lse -> (dq, dk, dv), each a custom call running the kernels."""
    options = dict(static)
    deterministic = options.pop("deterministic")
    # Defaults left out: a call with no feature keywords reuses flash_forward's cached launch plan.
    for name, default in (("window_size", None), ("softcap", 0.0)):
        if options[name] == default:
            del options[name]

    def forward_call(q, k, v):
        batch, seqlen_q, heads, _ = q.shape[-4:]
        lead = q.shape[:-4]
        results = (jax.ShapeDtypeStruct(q.shape[:-1] + v.shape[-1:], q.dtype),   # o: q's shape, v's head_dim
                   jax.ShapeDtypeStruct(lead + (batch, heads, seqlen_q), numpy.float32))
        return python_call(_ForwardCallback(options), results, vmap_method="broadcast_all")(q, k, v)

    def backward_call(do, q, k, v, o, lse):
        results = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
        return python_call(_BackwardCallback(options, deterministic), results,
                           vmap_method="broadcast_all")(do, q, k, v, o, lse)

    return forward_call, backward_call


@functools.lru_cache(maxsize=256)
def _attention(static: tuple):
    """The custom_vjp function of q, k, v -> (o, lse) for one set of options."""
    forward_call, backward_call = _calls(static)

    @jax.custom_vjp
    def attention(q, k, v):
        return forward_call(q, k, v)

    def attention_forward(q, k, v):
        o, lse = forward_call(q, k, v)
        return (o, lse), (q, k, v, o, lse)

    def attention_backward(saved, cotangents):
        q, k, v, o, lse = saved
        do, _ = cotangents   # lse's is zero: flash_forward stops its gradient
        return backward_call(do.astype(q.dtype), q, k, v, o, lse)

    attention.defvjp(attention_forward, attention_backward)
    return attention


def flash_attention_fp8(q, k, v, **options):
    """FP8 attention on float16 / bfloat16 / float32 JAX arrays (Hopper), differentiable in q, k,
    v: q, k, v are quantised to e4m3 inside (a descale per (batch, head), quantize_fp8's bits, no
    synchronisation: an input holding inf or NaN gives inf or NaN), then the FP8 forward; o comes
    back in q's dtype. The gradient is that of attention over the dequantised inputs
    (flash_backward's FP8 call), taken straight through the quantisation, in the inputs' dtypes.
    Options: softmax_scale, causal, window_size, deterministic (static); head_dim a multiple of 16."""
    static = _checks.check_traced_call("flash_attention_fp8 (JAX)", q, k, v, options)
    if dict(static)["softcap"]:
        raise ValueError("softcap is not supported with FP8 inputs (they take causal, window_size, sink, "
                         "GQA/MQA and packed batches)")
    if q.shape[-1] % 16:
        raise ValueError(f"q has head_dim {q.shape[-1]}; FP8 attention takes a multiple of 16 (rows are read in "
                         "16-byte units)")
    o = _fp8_attention(static, tuple(numpy.dtype(x.dtype).name for x in (q, k, v)))(q, k, v)
    return o if o.dtype == q.dtype else o.astype(q.dtype)


@functools.lru_cache(maxsize=256)
def _fp8_attention(static: tuple, dtypes: tuple):
    """The custom_vjp function of q, k, v (of ``dtypes``) -> o (bfloat16) for one set of options."""
    options = dict(static)
    deterministic = options.pop("deterministic")
    del options["softcap"]
    if options["window_size"] is None:
        del options["window_size"]

    def forward_call(q, k, v):
        lead, (batch, seqlen_q, heads, _) = q.shape[:-4], q.shape[-4:]
        results = ((jax.ShapeDtypeStruct(q.shape, jax.numpy.bfloat16),
                    jax.ShapeDtypeStruct(lead + (batch, heads, seqlen_q), numpy.float32))
                   + tuple(jax.ShapeDtypeStruct(x.shape, numpy.uint8) for x in (q, k, v))
                   + tuple(jax.ShapeDtypeStruct(x.shape[:-4] + (x.shape[-4], x.shape[-2]), numpy.float32) for x in (q, k, v)))
        return python_call(functools.partial(_fp8_forward_callback, options), results,
                           vmap_method="broadcast_all")(q, k, v)

    @jax.custom_vjp
    def attention(q, k, v):
        return forward_call(q, k, v)[0]

    def attention_forward(q, k, v):
        outputs = forward_call(q, k, v)
        return outputs[0], outputs

    def attention_backward(saved, do):
        o, lse, *quantised = saved
        results = tuple(jax.ShapeDtypeStruct(x.shape, jax.numpy.bfloat16) for x in quantised[:3])
        grads = python_call(functools.partial(_fp8_backward_callback, options, deterministic), results,
                            vmap_method="broadcast_all")(do.astype(jax.numpy.bfloat16), o, lse, *quantised)
        return tuple(g if g.dtype == dtype else g.astype(dtype) for g, dtype in zip(grads, dtypes))

    attention.defvjp(attention_forward, attention_backward)
    return attention


def _fp8_forward_callback(options, call):
    """flash_attention_fp8's forward: q, k, v quantised into their outputs, then the FP8 forward."""
    from . import fp8
    from ._checks import kernel_ready
    from .families import rows

    (q, k, v), (o, lse, *quantised) = call.inputs_described(), call.outputs_described()
    with _on_xla_stream(call), fp8.trusted_descales():
        bits, descales = quantised[:3], quantised[3:]
        for x, x8, descale in zip((q, k, v), bits, descales):
            rows.quantize_e4m3(kernel_ready(_folded(x)), out=(_folded(x8), _folded(descale, rank=2)))
        forward_into((_folded(o), _folded(lse, rank=3)), *(_folded(x8) for x8 in bits), **options,
                     **{name: _folded(d, rank=2) for name, d in zip(("q_descale", "k_descale", "v_descale"), descales)})


def _fp8_backward_callback(options, deterministic, call):
    """flash_attention_fp8's backward: flash_backward's FP8 call into XLA's dq, dk, dv."""
    from . import fp8

    outputs = call.outputs_described()
    do, o, lse, q8, k8, v8, q_descale, k_descale, v_descale = call.inputs_described()
    with _on_xla_stream(call), fp8.trusted_descales():
        descales = {name: _folded(d, rank=2) for name, d in zip(("q_descale", "k_descale", "v_descale"),
                                                                 (q_descale, k_descale, v_descale))}
        backward_into(tuple(_folded(x) for x in outputs), _folded(do), *(_folded(x) for x in (q8, k8, v8, o)),
                      _folded(lse, rank=3), deterministic=deterministic, **options, **descales)


# -------------------------------------------------------------------------------------------------
# The callbacks: XLA's buffers, launched on by address on XLA's stream.

class _ForwardCallback:
    """The forward's custom call: one per traced call, so its dtypes and options are fixed (its
    shapes too, but for jax.vmap of a traced call, which runs the same callback with a batch axis
    in front). The first execution on a stream with a given q shape takes XLA's buffers as CuPy
    views through flash_forward's checked route and keeps the plan it made; later ones launch that
    plan on the buffers' addresses (XLA's buffers are row-major and aligned, as the plan read them),
    the callback's whole cost being the host time XLA waits for."""

    def __init__(self, options: dict):
        self.options = options
        self.plans: dict = {}   # (XLA's stream, q's shape) -> the plan

    def __call__(self, call):
        key = (call.stream, call.shape(0))
        plan = self.plans.get(key)
        if plan is not None and _launch.ready_stream(plan, call.stream) is not None:
            plan.launch(call.inputs + call.outputs, call.stream, False)
            return
        (q, k, v), (o, lse) = call.inputs_described(), call.outputs_described()
        with _on_xla_stream(call):
            views = (_folded(q), _folded(k), _folded(v))
            forward_into((_folded(o), _folded(lse, rank=3)), *views, **self.options)
            if _plain(self.options):   # flash_forward kept its plan (unless it copied)
                plan = forward._plans.get(forward._plan_key(*views, self.options["softmax_scale"], self.options["causal"]))
                if plan is not None:
                    self.plans[key] = plan


class _BackwardCallback:
    """The backward's custom call (as _ForwardCallback; keyed by dO's shape)."""

    def __init__(self, options: dict, deterministic: bool):
        self.options, self.deterministic = options, deterministic
        self.plans: dict = {}

    def __call__(self, call):
        stream = call.stream
        key = (stream, call.shape(0))
        plan = self.plans.get(key)
        if plan is not None and _launch.ready_stream(plan, stream) is not None:
            workspace, _owner = plan.workspace_on(stream, functools.partial(_allocated_on, stream))
            first = plan.launch_first(call.inputs, workspace, stream, False)
            plan.launch_rest(first + call.outputs, stream, False)
            return
        outputs, inputs = call.outputs_described(), call.inputs_described()
        with _on_xla_stream(call):
            views = tuple(_folded(x, rank=3 if i == 5 else 4) for i, x in enumerate(inputs))
            backward_into(tuple(_folded(x) for x in outputs), *views, deterministic=self.deterministic, **self.options)
            if _plain(self.options):
                plan = backward._plans.get(backward._plan_key(*views, self.options["softmax_scale"], self.options["causal"],
                                                              self.deterministic))
                if plan is not None:
                    self.plans[key] = plan


def _plain(options: dict) -> bool:
    """No option but the scale and causal (_attention leaves out the defaults): a call flash_forward
    keeps the plan of."""
    return set(options) <= {"softmax_scale", "causal"}


class _on_xla_stream:
    """The call's device and XLA's stream, current for the launches inside."""

    def __init__(self, call):
        import cupy

        self.device = cupy.cuda.Device(call.device)
        self.stream = _stream(call.stream)

    def __enter__(self):
        self.device.__enter__()
        self.stream.__enter__()

    def __exit__(self, *exc):
        self.stream.__exit__(*exc)
        self.device.__exit__(*exc)


# The callback's host time is the adapter's whole cost, and a small call (a 4k causal forward,
# ~130 us of GPU time) is host-bound: with a new stream object and new CuPy views of every buffer
# per call it ran at 1.10x a direct call (H100). XLA runs a program on one stream and hands out
# the same addresses from call to call, so both are kept, by stream pointer and by (address,
# shape, dtype); a view holds no memory of its own (UnownedMemory), so keeping it keeps nothing.
_streams: dict = {}
_views: dict = {}


def _allocated_on(stream: int, nbytes: int):
    """``nbytes`` from CuPy's allocator with the stream at ``stream`` current: CuPy's pool hands the
    block out again in this stream's order only."""
    import cupy

    with _stream(stream):
        return cupy.cuda.alloc(nbytes)


def _stream(pointer: int):
    stream = _streams.get(pointer)
    if stream is None:
        from ._streams import as_cupy_stream

        stream = _streams[pointer] = as_cupy_stream(pointer)
    return stream


def _folded(buffer, rank: int = 4):
    """A CuPy view of an XLA buffer (row-major, no copy) of ``rank`` dimensions, the axes jax.vmap
    put in front folded into the batch: (..., batch, seqlen, heads, d), or lse's (..., batch, heads,
    seqlen) with rank 3."""
    array = _as_cupy(buffer)
    if array.ndim > rank:
        array = array.reshape((-1,) + array.shape[array.ndim - rank + 1:])
    return array


def _as_cupy(buffer):
    """A CuPy array over an XLA buffer's memory (an ``_xla_ffi.Buffer``: row-major; XLA keeps the
    memory for the call)."""
    key = (buffer.pointer, buffer.shape, buffer.dtype, buffer.device)
    view = _views.get(key)
    if view is None:
        import cupy

        pointer, shape, dtype, device = key
        shape, dtype = tuple(int(n) for n in shape), numpy.dtype(dtype)
        if "float8" in str(dtype):   # CuPy holds no FP8 dtype: the bits (the kernels' form)
            dtype = numpy.dtype(numpy.uint8)
        nbytes = int(numpy.prod(shape, dtype=numpy.int64)) * dtype.itemsize
        memory = cupy.cuda.UnownedMemory(pointer, nbytes, None, int(device))
        view = cupy.ndarray(shape, dtype=dtype, memptr=cupy.cuda.MemoryPointer(memory, 0))
        kept(_views, key, view, limit=1024)
    return view


# -------------------------------------------------------------------------------------------------
# Decoding against a K/V cache updated in place.

DECODE_OPTIONS = ("softmax_scale", "causal", "window_size", "softcap", "rotary_interleaved")
# flash_decode's array options, passed to the callback beside the arrays (in this order, where given).
DECODE_ARRAYS = ("block_table", "cache_batch_idx", "cache_leftpad", "rotary_cos", "rotary_sin", "k_descale", "v_descale")


def flash_decode(q, k_cache, v_cache, cache_seqlens, k_new=None, v_new=None, **options):
    """cupy_flash.flash_decode on JAX arrays: k_new and v_new (if given) are written into the caches
    at rows cache_seqlens[b].., then q attends to cache_seqlens[b] + seqlen_new keys. Returns
    ``(o, k_cache, v_cache)``, the caches with the new rows in. MLA's latent cache (JAX has no views):
    v_cache=None with ``head_dim_v``, v the first head_dim_v columns of each k_cache row, v_new None;
    then ``(o, k_cache, None)``, and flash_decode's MLA kernel runs. The caches are the call's outputs
    aliased to its inputs: donate them (``jax.jit(step, donate_argnums=...)``) and XLA hands the
    same memory through, so only the new rows are written; without donation XLA first copies each
    cache to keep the input intact. Options as flash_decode's: softmax_scale, causal, window_size,
    softcap, and the arrays block_table (a paged cache), cache_batch_idx, cache_leftpad,
    rotary_cos / rotary_sin (with rotary_interleaved), k_descale / v_descale (an FP8 cache of
    ``jnp.float8_e4m3fn`` or uint8 bits). Not differentiable. o and lse are copied once from the
    kernels' outputs (a decode step's few query rows)."""
    unknown = sorted(set(options) - set(DECODE_OPTIONS) - set(DECODE_ARRAYS) - {"head_dim_v"})
    if unknown:
        raise TypeError(f"flash_decode (JAX) got unsupported option(s) {unknown}; it takes "
                        f"{list(DECODE_OPTIONS + DECODE_ARRAYS + ('head_dim_v',))}")
    from .decode import check_decode, check_latent_v, check_rotary

    options = dict(options)
    head_dim_v = check_latent_v(k_cache, v_cache, v_new, options.pop("head_dim_v", None),
                                options.get("rotary_cos") is not None or options.get("rotary_sin") is not None)
    arrays = {name: options.pop(name) for name in DECODE_ARRAYS if options.get(name) is not None}
    described = {name: _described(x) for name, x in dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens,
                                                         k_new=k_new, v_new=v_new, **arrays).items() if x is not None}
    if head_dim_v is not None:   # v: the first head_dim_v columns of k's rows (and of k_new's)
        options["head_dim_v"] = head_dim_v
        described["v_cache"] = _checks._Described.of(k_cache.shape[:3] + (head_dim_v,), described["k_cache"].dtype)
        if k_new is not None:
            described["v_new"] = _checks._Described.of(k_new.shape[:3] + (head_dim_v,), k_new.dtype)
        if "k_descale" in arrays and "v_descale" not in arrays:
            described["v_descale"] = described["k_descale"]
    shape, _ = check_decode(*(described.get(name) for name in ("q", "k_cache", "v_cache", "cache_seqlens", "k_new", "v_new",
                                                               "block_table", "cache_batch_idx", "cache_leftpad",
                                                               "k_descale", "v_descale")))
    check_rotary(described.get("rotary_cos"), described.get("rotary_sin"), options.get("rotary_interleaved", False),
                 described["q"], shape)
    if options.get("window_size") is not None:
        options["window_size"] = tuple(int(n) for n in options["window_size"])
    caches = (k_cache,) if head_dim_v is not None else (k_cache, v_cache)
    results = (jax.ShapeDtypeStruct(q.shape[:-1] + (shape.head_dim_v,), q.dtype),
               jax.ShapeDtypeStruct((shape.batch, shape.heads, shape.seqlen_q), numpy.float32),
               *(jax.ShapeDtypeStruct(cache.shape, cache.dtype) for cache in caches))
    new = () if k_new is None else (k_new,) if head_dim_v is not None else (k_new, v_new)
    static = (tuple(sorted(options.items())), len(caches), len(new), tuple(arrays))
    call = python_call(functools.partial(_decode_callback, static), results,
                       input_output_aliases={1 + i: 2 + i for i in range(len(caches))})
    o, _, *caches = call(q, *caches, cache_seqlens, *new, *arrays.values())
    return o, caches[0], caches[1] if len(caches) > 1 else None


def _described(x):
    """check_decode's view of a JAX array: its shape, and an e4m3 array as the uint8 bits it holds."""
    described = _checks._Described(x)
    if "float8_e4m3fn" in str(x.dtype):
        described.dtype = numpy.dtype(numpy.uint8)
    return described


def _decode_callback(static, call):
    from .decode import flash_decode as decode

    options, caches, news, names = static   # caches: 1 (v the first columns of k) or 2, news: 0 to 2
    o, lse, *cache_out = call.outputs_described()   # the caches' memory (aliased to the inputs)
    q, *rest = call.inputs_described()
    with _on_xla_stream(call):
        k_out, v_out = _as_cupy(cache_out[0]), _as_cupy(cache_out[1]) if caches == 2 else None
        cache_seqlens, rest = rest[caches], rest[caches + 1:]
        k_new, v_new = (tuple(_as_cupy(x) for x in rest[:news]) + (None, None))[:2]
        arrays = {name: _as_cupy(x) for name, x in zip(names, rest[news:])}
        result = decode(_as_cupy(q), k_out, v_out, cache_seqlens=_as_cupy(cache_seqlens),
                        k_new=k_new, v_new=v_new, **arrays, **dict(options))
        _as_cupy(o)[...] = result[0]
        _as_cupy(lse)[...] = result[1]


# -------------------------------------------------------------------------------------------------
# Ring attention over a mesh axis: context parallelism under jax.jit, without MPI.

def shard_map(function, mesh, in_specs, out_specs):
    """``jax.shard_map`` (``jax.experimental.shard_map`` on older JAX) of ``function`` without the
    replication check (``check_vma``, formerly ``check_rep``), which the kernels' callbacks cannot
    satisfy: what ring_attention and ulysses_attention are called inside."""
    make = getattr(jax, "shard_map", None)
    if make is None:
        from jax.experimental.shard_map import shard_map as make
    for check in ({"check_vma": False}, {"check_rep": False}):
        try:
            return make(function, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **check)
        except TypeError:
            continue
    raise RuntimeError("no shard_map signature fits this JAX")


def ring_attention(q, k, v, axis_name, *, causal=False, softmax_scale=None, deterministic=False, window_size=None,
                   softcap=0.0, sink=None):
    """Exact attention over a sequence sharded along the mesh axis ``axis_name``, called inside
    ``jax.shard_map`` with q, k, v the rank's shard (batch, local_seqlen, heads, head_dim) and the
    sequence axis split over ``axis_name``; returns o of the shard's rows. The ring of
    cupy_flash.distributed on XLA's collectives: K/V shards travel by ``jax.lax.ppermute`` (the next
    one issued before this one is attended), the partial outputs merge through their logsumexp in
    float32, and the gradient (a ``jax.custom_vjp``) sends K/V around again with float32 dK/dV
    accumulators that arrive home summed; dQ stays local. With ``causal`` the shards must be in
    zigzag order (``distributed.zigzag_indices(seqlen, world)`` permutes the full sequence so that
    the mesh's contiguous split gives each rank chunks r and 2P - 1 - r), so that every rank does
    the same work at every step (``distributed.ring_blocks``); local_seqlen is then even.
    ``softcap`` caps every block's logits; ``window_size`` = (left, right) is a band over global
    positions, as flash_forward's: shards in zigzag order too, and each step runs the blocks of its
    chunk pairs that the band reaches (``distributed.ring_blocks``, chosen per rank by
    ``jax.lax.switch``), so a step the band misses runs nothing. ``sink``: a logit per query head
    (heads,), replicated over the axis (``PartitionSpec()``), counted once in each row's softmax
    (joined after the merge, as cupy_flash.distributed does); its gradient is the rank's rows' part,
    which shard_map sums over the axis as it does for any replicated input."""
    static = _checks.check_traced_call("ring_attention (JAX)", q, k, v,
                                       dict(softmax_scale=softmax_scale, causal=causal, deterministic=deterministic,
                                            window_size=window_size, softcap=softcap))
    from .distributed import banded

    options = dict(static)
    if (options["causal"] or banded(options["causal"], options["window_size"])) and q.shape[-3] % 2:
        raise ValueError(f"q has {q.shape[-3]} rows a shard; causal or windowed ring attention takes zigzag shards of "
                         "two equal chunks")
    if tuple(k.shape[-4:-2]) != tuple(q.shape[-4:-2]):
        raise ValueError(f"k has shape {tuple(k.shape)} but q has {tuple(q.shape)}; ring shards hold the same rows of q, k, v")
    if sink is None:
        return _ring(static, axis_name)(q, k, v)
    if getattr(sink, "shape", None) != (q.shape[-2],) or not jax.numpy.issubdtype(sink.dtype, jax.numpy.floating):
        raise ValueError(f"sink must be a float array of shape ({q.shape[-2]},) (a logit per query head), got "
                         f"{getattr(sink, 'dtype', type(sink).__name__)} of shape {tuple(getattr(sink, 'shape', ()))}")
    return _ring(static, axis_name)(q, k, v, sink)


def _axis_size(axis_name) -> int:
    """The size of mesh axis ``axis_name``, a Python int while tracing inside shard_map."""
    size = getattr(jax.lax, "axis_size", None)
    return int(size(axis_name)) if size is not None else int(jax.lax.psum(1, axis_name))


def _with(static: tuple, **changed) -> tuple:
    return tuple((name, changed.get(name, value)) for name, value in static)


@functools.lru_cache(maxsize=64)
def _ring(static: tuple, axis_name):
    """The custom_vjp ring function of q, k, v (and a sink) -> o for one set of options and mesh
    axis."""
    from .distributed import banded, ring_blocks

    options = dict(static)
    causal, window = options["causal"], options["window_size"]
    windowed = banded(causal, window)
    unbanded = _with(static, window_size=None)   # (a window the causal mask already is: none)
    full = _calls(_with(unbanded, causal=False))      # no mask
    masked = _calls(_with(unbanded, causal=True))     # the own shard, causal
    jnp = jax.numpy

    def world() -> int:
        return _axis_size(axis_name)

    def shift(xs: tuple) -> tuple:
        size = world()
        return tuple(jax.lax.ppermute(x, axis_name, [(i, (i + 1) % size) for i in range(size)]) for x in xs)

    def as_f32(xs: tuple) -> tuple:
        return tuple(x.astype(jnp.float32) for x in xs)

    def merge(o_acc, lse_acc, o, lse):
        """Two partial (o, lse) of the same rows merged exactly through their logsumexp (float32)."""
        merged = jnp.logaddexp(lse_acc, lse)
        seen = jnp.isfinite(merged)
        safe = jnp.where(seen, merged, 0.0)
        weights = [jnp.where(seen, jnp.exp(x - safe), 0.0).transpose(0, 2, 1)[..., None] for x in (lse_acc, lse)]
        return o_acc * weights[0] + o.astype(jnp.float32) * weights[1], merged

    def block_calls(block):
        return _calls(_with(unbanded, causal=block.causal, window_size=block.window))

    def schedules(step, rows):
        """Each rank's blocks at ``step`` (static: a jax.lax.switch branch a rank)."""
        return [ring_blocks(r, world(), step, causal, rows, window) for r in range(world())]

    def attend_banded(step, rank, q, k, v):
        """(o, lse) in float32 of the blocks the band reaches at ``step`` (none: lse -inf)."""
        batch, rows, heads = q.shape[:3]

        def branch(blocks):
            def run(q, k, v):
                o_acc = jnp.zeros((batch, rows, heads, v.shape[-1]), jnp.float32)
                lse_acc = jnp.full((batch, heads, rows), -jnp.inf, jnp.float32)
                for b in blocks:
                    o, lse = block_calls(b)[0](q[:, b.q_start:b.q_stop], k[:, b.k_start:b.k_stop], v[:, b.k_start:b.k_stop])
                    o_full = jnp.zeros_like(o_acc).at[:, b.q_start:b.q_stop].set(o.astype(jnp.float32))
                    lse_full = jnp.full_like(lse_acc, -jnp.inf).at[:, :, b.q_start:b.q_stop].set(lse)
                    o_acc, lse_acc = merge(o_acc, lse_acc, o_full, lse_full)
                return o_acc, lse_acc
            return run
        return jax.lax.switch(rank, [branch(blocks) for blocks in schedules(step, rows)], q, k, v)

    def gradients_banded(step, rank, do, q, k, v, o, lse):
        """(dq, dk, dv) in float32 of attend_banded's blocks."""
        def branch(blocks):
            def run(do, q, k, v, o, lse):
                dq, dk, dv = (jnp.zeros(x.shape, jnp.float32) for x in (q, k, v))
                for b in blocks:
                    rows, keys = slice(b.q_start, b.q_stop), slice(b.k_start, b.k_stop)
                    parts = block_calls(b)[1](do[:, rows], q[:, rows], k[:, keys], v[:, keys], o[:, rows], lse[:, :, rows])
                    dq = dq.at[:, rows].add(parts[0].astype(jnp.float32))
                    dk = dk.at[:, keys].add(parts[1].astype(jnp.float32))
                    dv = dv.at[:, keys].add(parts[2].astype(jnp.float32))
                return dq, dk, dv
            return run
        return jax.lax.switch(rank, [branch(blocks) for blocks in schedules(step, q.shape[1])], do, q, k, v, o, lse)

    def attend(step, rank, q, k, v):
        """(o, lse) of the local queries against the K/V shard held at ``step``; rows a step does not
        see get lse -inf (ring_blocks: the own shard causal; an earlier rank's first chunk for every
        query; a later rank's whole shard for the second chunk of queries)."""
        if windowed:
            return attend_banded(step, rank, q, k, v)
        if not causal:
            return full[0](q, k, v)
        if step == 0:
            return masked[0](q, k, v)
        half = q.shape[1] // 2

        def earlier(q, k, v):
            return full[0](q, k[:, :half], v[:, :half])

        def later(q, k, v):
            o, lse = full[0](q[:, half:], k, v)
            return (jnp.concatenate((jnp.zeros_like(o), o), axis=1),
                    jnp.concatenate((jnp.full(lse.shape, -jnp.inf, lse.dtype), lse), axis=2))
        return jax.lax.cond(rank >= step, earlier, later, q, k, v)

    def gradients(step, rank, do, q, k, v, o, lse):
        """(dq, dk, dv) pieces of ``attend``'s calls, float32, of the local q's and the held shard's rows."""
        if windowed:
            return gradients_banded(step, rank, do, q, k, v, o, lse)
        if not causal:
            return as_f32(full[1](do, q, k, v, o, lse))
        if step == 0:
            return as_f32(masked[1](do, q, k, v, o, lse))
        half = q.shape[1] // 2

        def earlier(do, q, k, v, o, lse):
            dq, dk, dv = as_f32(full[1](do, q, k[:, :half], v[:, :half], o, lse))
            return dq, *(jnp.concatenate((x, jnp.zeros_like(x)), axis=1) for x in (dk, dv))

        def later(do, q, k, v, o, lse):
            dq, dk, dv = as_f32(full[1](do[:, half:], q[:, half:], k, v, o[:, half:], lse[:, :, half:]))
            return jnp.concatenate((jnp.zeros_like(dq), dq), axis=1), dk, dv
        return jax.lax.cond(rank >= step, earlier, later, do, q, k, v, o, lse)

    def forward(q, k, v, sink=None):
        rank = jax.lax.axis_index(axis_name)
        batch, rows, heads = q.shape[:3]
        o_acc = jnp.zeros((batch, rows, heads, v.shape[-1]), jnp.float32)
        lse_acc = jnp.full((batch, heads, rows), -jnp.inf, jnp.float32)
        held = (k, v)
        for step in range(world()):
            coming = shift(held) if step + 1 < world() else None   # in flight while this shard is attended
            o, lse = attend(step, rank, q, *held)
            o_acc, lse_acc = merge(o_acc, lse_acc, o, lse)
            held = coming
        if sink is not None:   # once, after the merge: lse takes exp(sink), o its share of the row
            joined = jnp.logaddexp(lse_acc, sink.astype(jnp.float32)[None, :, None])
            o_acc = o_acc * jnp.exp(lse_acc - joined).transpose(0, 2, 1)[..., None]
            lse_acc = joined
        return o_acc.astype(q.dtype), lse_acc

    def backward(q, k, v, o, lse, do):
        """(dq, dk, dv) through the ring: the steps' blocks with the merged o and lse (the sink's
        too, where there is one: its probability is then left out of every block's P)."""
        rank = jax.lax.axis_index(axis_name)
        dq = jnp.zeros(q.shape, jnp.float32)
        held = (k, v, jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
        for step in range(world()):
            if step:
                held = shift(held)   # the accumulators travel with their K/V
            dq_part, dk_part, dv_part = gradients(step, rank, do, q, held[0], held[1], o, lse)
            dq = dq + dq_part
            held = (held[0], held[1], held[2] + dk_part, held[3] + dv_part)
        dk, dv = shift(held[2:])   # one more shift: home
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)

    def sink_gradient(do, o, lse, sink):
        """This rank's rows' part of dsink: -sum over batch and rows of P_sink * rowsum(dO * O)."""
        delta = (do.astype(jnp.float32) * o.astype(jnp.float32)).sum(-1).transpose(0, 2, 1)   # (batch, heads, rows)
        return -(jnp.exp(sink.astype(jnp.float32)[None, :, None] - lse) * delta).sum(axis=(0, 2)).astype(sink.dtype)

    # The sink, where there is one, is the function's fourth argument (``sink`` below: () or (it,)).
    @jax.custom_vjp
    def ring(q, k, v, *sink):
        return forward(q, k, v, *sink)[0]

    def ring_forward(q, k, v, *sink):
        o, lse = forward(q, k, v, *sink)
        return o, (q, k, v, o, lse, sink)

    def ring_backward(saved, do):
        q, k, v, o, lse, sink = saved
        do = do.astype(q.dtype)
        return backward(q, k, v, o, lse, do) + tuple(sink_gradient(do, o, lse, x) for x in sink)

    ring.defvjp(ring_forward, ring_backward)
    return ring


def ulysses_attention(q, k, v, axis_name, **options):
    """Exact attention over a sequence split along the mesh axis ``axis_name`` by all-to-all over the
    heads (DeepSpeed-Ulysses), inside ``jax.shard_map``: q, k, v are the rank's contiguous shard
    (batch, local_seqlen, heads, head_dim); ``jax.lax.all_to_all`` regathers the sequence and splits
    the heads (each rank then holds heads / P of them over the whole sequence), ``flash_attention``
    runs there with every one of its options (causal, window_size, softcap, softmax_scale,
    deterministic), and a second all-to-all returns o to the sequence split. Differentiable (the
    all-to-alls' transposes are all-to-alls). Query and K/V heads must be multiples of the axis size
    (repeat K/V heads to use more ranks than there are K/V heads)."""
    world = _axis_size(axis_name)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(f"{name} must have 4 dimensions (batch, local_seqlen, heads, head_dim), "
                             f"got shape {tuple(getattr(x, 'shape', ()))}")
        if x.shape[2] % world:
            raise ValueError(f"{name} has {x.shape[2]} heads, not a multiple of the {world} ranks of axis "
                             f"{axis_name!r}: all-to-all gives each rank heads / {world} of them (repeat the K/V "
                             "heads, or use ring_attention)")

    def to_heads(x):     # (b, n / P, h, d) -> (b, n, h / P, d)
        return jax.lax.all_to_all(x, axis_name, split_axis=2, concat_axis=1, tiled=True)

    o = flash_attention(to_heads(q), to_heads(k), to_heads(v), **options)
    return jax.lax.all_to_all(o, axis_name, split_axis=1, concat_axis=2, tiled=True)   # back to the sequence split
