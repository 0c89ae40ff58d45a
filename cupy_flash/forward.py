"""Forward launch: ``flash_forward`` / ``flash_attention``."""

from __future__ import annotations

import contextlib
import ctypes

from . import _checks, _padding, _tma, families
from ._launch import (
    Launch,
    OutputAndLse,
    Packed,
    TileCounters,
    cached,
    cuda_calls,
    current_stream,
    kept,
    packed_once,
    ready_stream,
)
from ._params import PointerRecord, make_params
from ._streams import STREAM_DOC, on_stream, record_kernel_arrays
from .decode import check_num_splits, launch_decode, uses_split_path
from .forward_fp8 import forward_fp8, is_fp8_call

_SM90_MAPS_BYTES = _tma.FORWARD_MAPS_BYTES
_NAMES = ("q", "k", "v", "o", "lse")   # a forward launch's arrays, in the order of its addresses
_BINDINGS = {name: name for name in _NAMES}   # the pointer fields a forward call fills


class ForwardPlan(OutputAndLse):
    """Everything a forward launch needs but the arrays' addresses: the kernel, its grid, block and
    shared memory, the params record (a PointerRecord: the q, k, v, o, lse fields written per call)
    and, on Hopper, the arrays' layouts its tensor maps are encoded from. A plan is a function of
    the checked call (shapes, strides, dtype, options, device), so calls that repeat one (a training
    loop) reuse it: see flash_forward's plan cache. It launches on addresses (``launch``), so the
    adapters run it on their framework's buffers."""

    def __init__(self, family: str, launch: Launch, params, o, lse_shape: tuple, variant, maps: tuple = (),
                 tile_counter_bytes: int = 0):
        self.cuda = cuda_calls()
        self.family, self.kernel_launch = family, launch
        self.record = PointerRecord(params, _BINDINGS)
        self.plan_outputs(o, lse_shape)
        # The variant's device arrays (slopes, sink, bias as float32, cu_seqlens) that params points
        # at: held as long as the plan, so they outlive the launch. Plain plans hold none.
        self.variant_arrays = tuple(x for x in variant.device_arrays() if x is not None)
        # Hopper: (dtype, q box rows, k/v box rows, packed, the q, k, v, o layouts); else ()
        self.maps = maps
        # Hopper: blocks take tiles from a counter of this size (0: they do not), one per (host
        # thread, stream).
        self._counters = TileCounters(tile_counter_bytes) if tile_counter_bytes else None
        self.device = self.cuda.get_device()   # the kernel handle's
        self._launches: dict = {}   # Packed by the arrays' addresses, stream and thread (packed_once)
        self._input_maps: dict = {}    # the q, k, v maps by their addresses
        self._output_maps: dict = {}   # the o map by its address

    def call(self, q, k, v):
        """The repeated plain call (flash_forward's plan cache found this plan for q, k, v): (o, lse)
        in new arrays, or None where the plan cannot launch as it is (another current device, a
        stream capturing a graph, whose temporaries the general path keeps alive)."""
        stream = ready_stream(self)
        if stream is None:
            return None
        o, lse = self.outputs()
        self.launch((q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr, lse.data.ptr), stream, False)
        return o, lse

    def run(self, q, k, v, out=None):
        """Launch on kernel-ready q, k, v of the planned shapes, strides and device, on the current
        stream; returns (o, lse), written into ``out`` = (o, lse) where given (check_outputs'
        layout), else allocated."""
        o, lse = self.outputs() if out is None else out
        record_kernel_arrays((q, k, v, o, lse) + self.variant_arrays)
        stream, capturing = current_stream()
        self.launch((q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr, lse.data.ptr), stream, capturing)
        return o, lse

    def launch(self, addresses: tuple, stream: int, capturing: bool) -> None:
        """Launch with q, k, v, o, lse at ``addresses`` on the stream at ``stream`` (``capturing``:
        it is capturing a graph). A training loop's calls pack nothing (~6 us of the host time
        before the launch, which the GPU waits for)."""
        packed_once(self._launches, addresses, stream, capturing,
                    lambda: self._packed(addresses, stream, capturing)).run()

    def _packed(self, addresses: tuple, stream: int, capturing: bool) -> Packed:
        record = self.record.filled(dict(zip(_NAMES, addresses)))
        if not self.maps:
            arguments = (record,)
        else:
            counter = self._counters.address(stream, capturing) if self._counters is not None else 0
            arguments = (self._sm90_maps(addresses), record, ctypes.c_uint64(counter))
        launch = self.kernel_launch
        return Packed(((launch.kernel, launch.grid, launch.threads, launch.smem, arguments, False),), stream,
                      (self.family, (launch.name,)))

    def _sm90_maps(self, addresses: tuple):
        """The kernel's ForwardSm90Maps argument (q, k, v, o tensor maps), the inputs' and the
        output's each cached by their addresses (the layouts are the plan's): repeated calls on the
        same buffers (a training loop) encode nothing, and an output whose memory the pool hands out
        again (the last call's o, freed) finds its map."""
        dtype, block_m, block_n, packed, (q, k, v, o) = self.maps
        q_at, k_at, v_at, o_at = addresses[:4]
        inputs = cached(self._input_maps, (q_at, k_at, v_at), lambda: (
            _tma.attention_map_at(q_at, q, dtype, block_m, packed) + _tma.attention_map_at(k_at, k, dtype, block_n, packed)
            + _tma.attention_map_at(v_at, v, dtype, block_n, packed)))
        output = cached(self._output_maps, o_at, lambda: _tma.attention_map_at(o_at, o, dtype, _tma.STORE_ROWS, packed))
        return ctypes.create_string_buffer(inputs + output, _SM90_MAPS_BYTES)


def forward_plan(q, k, v, shape, scale, variant, config: tuple = ()) -> ForwardPlan:
    """The plan of a checked call on kernel-ready arrays, on the family families.forward_family
    picks; ``variant`` (a checked ``_features.Variant``) selects the instantiation by its flags.
    ``config`` (block_m, tile, block_n, stages) overrides the Hopper tile table (bench/tile_sweep.py)."""
    import cupy

    variant = variant.on_device()
    lse_shape = lse_shape_of(shape, variant)
    # The record is filled from stand-ins of o and lse (make_params reads their strides and
    # addresses); run() writes the real addresses.
    o = cupy.ndarray(o_shape_of(q, shape), dtype=q.dtype, memptr=q.data)
    lse = cupy.ndarray(lse_shape, dtype=cupy.float32, memptr=q.data)
    params = make_params(shape, scale, variant=variant, q=q, k=k, v=v, o=o, lse=lse)
    device = families.current_device()
    family = families.forward_family(device, shape, variant, arrays=(q, k, v))
    options = {"config": config} if config else {}
    launch, maps, counter_bytes = family.forward_launch(device, shape, variant, (q, k, v, o), **options)
    return ForwardPlan(family.name, launch, params, o, lse_shape, variant, maps, counter_bytes)


def flash_forward(q, k, v, *, softmax_scale=None, causal=False, num_splits=None, stream=None, **features):
    """Exact attention ``softmax(softmax_scale * q k^T) v`` without materialising the scores.

    q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim) with
    heads_q a multiple of heads_kv (MQA/GQA); float16, bfloat16 (``ml_dtypes.bfloat16``) or
    float32, head_dim up to 256; v's head_dim may differ (o takes it), also up to 256. Head dims
    that are not a multiple of 8 run on zero-padded copies (FlashAttention-2's way; the outputs
    have the real shapes). CuPy arrays, or GPU arrays of other frameworks
    (taken through ``__cuda_array_interface__``/DLPack without a copy). Views whose rows are not
    contiguous and 16-byte aligned are copied once.

    ``causal=True`` masks key j for query i unless j <= i + seqlen_k - seqlen_q (bottom-right).
    Variants (any combination):
      ``window_size=(left, right)``: query i sees keys j with i + shift - left <= j <= i + shift + right
          (shift = seqlen_k - seqlen_q; -1 = unbounded; with causal, right is 0);
      ``softcap=c > 0``: logits become c * tanh(logit / c);
      ``alibi_slopes`` (heads_q,) or (batch, heads_q): logits get -slope * |i + shift - j|;
      ``sink`` (heads_q,): a logit per head that joins every row's softmax and carries no value;
      ``bias`` broadcastable to (batch, heads_q, seqlen_q, seqlen_k): added to the logits (after
          softcap and ALiBi); -inf masks. Read as float32 (another float dtype is converted once).
    Packed variable-length batches: ``cu_seqlens_q``, ``cu_seqlens_k`` (int32 (batch + 1,) prefix
    sums on the GPU; read back once to check them) with q (total_q, heads_q, head_dim) and k, v
    (total_k, heads_kv, head_dim); ``max_seqlen_q/k`` default to the longest sequence. Each sequence
    is attended on its own (causal and windows aligned to its own bottom-right corner); no padding
    is computed. Not combined with ``bias``. With ``block_table`` (int32 (batch, pages per
    sequence)) k and v are a paged cache (pages, page_size, heads_kv, head_dim) in flash_decode's
    layout (page_size a power of two >= 16): key j of sequence b is row j % page_size of page
    block_table[b, j // page_size], and cu_seqlens_k counts each sequence's keys (prefill straight
    from the pages; float16 / bfloat16 on the tensor-core kernels; flash_backward refuses it).

    FP8 (Hopper): q, k, v uint8 arrays of e4m3 bits (``quantize_fp8``'s) with ``q_descale``
    (batch, heads_q) or (batch, heads_kv), ``k_descale`` and ``v_descale`` (batch, heads_kv); o is
    bfloat16. Takes causal, window_size, sink, GQA/MQA and packed batches (docs/fp8.md).

    Split-KV: with float16/bfloat16, when each K/V head has few query rows (group x seqlen_q <= 32,
    e.g. decoding) the keys are split into ranges computed in parallel and merged exactly
    (``num_splits``: how many; default chosen from the SM count and the work; giving it takes this
    path whenever the variant allows: not with bias or packed batches).

    Returns ``(o, lse)``: o like q with v's head_dim; lse float32 (batch, heads_q, seqlen_q) (packed: (heads_q,
    total_q)), the natural-log logsumexp of the logits (the sink included), -inf (with o = 0) for
    a row that sees no key.
    """
    # A repeated plain call on CuPy arrays takes its checked plan (_plans) and launches: no checks,
    # no stream wrapper (the host time before the launch is what a short call's GPU waits for).
    if stream is None and num_splits is None:
        plan = _plans.get(_plan_key(q, k, v, softmax_scale, causal, features))
        if plan is not None:
            result = plan.call(q, k, v)
            if result is not None:
                return result
    return forward_into(None, q, k, v, softmax_scale=softmax_scale, causal=causal, num_splits=num_splits,
                        stream=stream, **features)


flash_forward.__doc__ = flash_forward.__doc__.rstrip() + "\n" + STREAM_DOC


@on_stream
def forward_into(out, q, k, v, *, softmax_scale=None, causal=False, num_splits=None, **features):
    """flash_forward writing into ``out`` = (o, lse), C-contiguous GPU arrays of the output shapes
    and dtypes on q's device (None: allocated): the adapters hand over their framework's buffers.
    No checks are skipped; ``out`` is checked after the inputs, before any launch."""
    if is_fp8_call(q, features):
        if num_splits is not None:
            raise ValueError("num_splits: the FP8 forward has no split-KV path")
        return forward_fp8(out, q, k, v, softmax_scale, causal, features)
    if _padding.needs_padding(q, v):   # a head_dim that is not a multiple of 8: padded copies
        return _padding.forward(forward_into, out, q, k, v, softmax_scale, causal, num_splits, features)
    key = _plan_key(q, k, v, softmax_scale, causal, features) if num_splits is None else None
    if key is not None:
        plan = _plans.get(key)
        if plan is not None and plan.device == plan.cuda.get_device():
            return plan.run(q, k, v, check_outputs(out, plan.o_shape, plan.lse_shape, q))
    _checks.check_no_extra_options("flash_forward", features)
    num_splits = check_num_splits(num_splits)
    given = (q, k, v)
    q, k, v, shape, scale, variant = _checks.prepare_qkv(q, k, v, softmax_scale, causal, features)
    with q.device:
        _checks.same_device(q=q, k=k, v=v)
        q, k, v = (_checks.kernel_ready(x) for x in (q, k, v))
        out = check_outputs(out, o_shape_of(q, shape), lse_shape_of(shape, variant), q)
        if uses_split_path(shape, variant, num_splits):
            return launch_decode(q, k, v, shape, scale, variant, num_splits, out=out)
        plan = forward_plan(q, k, v, shape, scale, variant)
        if key is not None and all(x is y for x, y in zip((q, k, v), given)):   # checked, and no copy made
            kept(_plans, key, plan)
        return plan.run(q, k, v, out)


def lse_shape_of(shape, variant) -> tuple:
    """(batch, heads_q, seqlen_q), or (heads_q, total_q) for a packed batch."""
    return (shape.batch, shape.heads, shape.seqlen_q) if variant.packed is None else (shape.heads, variant.packed.total_q)


def o_shape_of(q, shape) -> tuple:
    """o's shape: q's, with v's head_dim."""
    return tuple(q.shape[:-1]) + (shape.head_dim_v,)


def check_outputs(out, o_shape: tuple, lse_shape: tuple, q):
    """``out`` = (o, lse) as CuPy views (None: None), or ValueError naming the one that does not fit:
    o of ``o_shape`` and q's dtype, lse float32 of ``lse_shape``, both C-contiguous on q's device."""
    if out is None:
        return None
    device = q.data.device_id
    return (_checks.output_buffer("o", out[0], o_shape, q.dtype, device),
            _checks.output_buffer("lse", out[1], lse_shape, "float32", device))


# Plans of plain calls (no feature keywords) that passed the checks with q, k, v readable as they
# are, by everything the checks and the plan read: a repeated call skips both (~100 us of Python
# on the H100's host; bench/host_overhead.py). A key holds no array: only shapes, strides, dtypes,
# address alignments and device ids, the scale and causal (with their types: True == 1.0 in a
# dict), and the kernels setting.
_plans: dict = {}


@contextlib.contextmanager
def plain_causal_tiles_from(keys: int):
    """Inside (this thread or task): plain causal Hopper forward calls take families.sm90.FORWARD_SM90_PLAIN's
    tiles from ``keys`` keys instead of FORWARD_SM90_PLAIN_CAUSAL_MIN_KEYS (the GPU tests and the
    sanitizer workload, so short causal calls run both tile shapes). A plan's key does not hold the
    rule, so the plans made under either are dropped on the way in and out."""
    _plans.clear()
    token = families.sm90.plain_causal_min_keys.set(keys)
    try:
        yield
    finally:
        families.sm90.plain_causal_min_keys.reset(token)
        _plans.clear()


def _plan_key(q, k, v, softmax_scale, causal, features=None):
    """The plan cache's key of a plain call, or of a packed one whose offsets' host copies are
    known (_checks.known_offsets_key); None for any other call."""
    if not features:
        return _checks.qkv_key(q, k, v, softmax_scale, causal, families.kernels_setting())
    packed = _checks.known_offsets_key(features)
    key = None if packed is None else _checks.qkv_key(q, k, v, softmax_scale, causal, families.kernels_setting())
    return None if key is None else key + packed


@on_stream
def flash_attention(q, k, v, **options):
    """``flash_forward(...)[0]``: the attention output only."""
    return flash_forward(q, k, v, **options)[0]
