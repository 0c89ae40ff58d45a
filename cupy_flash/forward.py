"""Forward launch: ``flash_forward`` / ``flash_attention``."""

from __future__ import annotations

import contextlib
import ctypes
import functools

from . import _checks, _families, _tma, _traits
from ._compile import ModuleSpec, device_value, get_kernel
from ._launch import TileCounters, cached, kept, kernel_parameters, launch_buffers, packed_once
from ._params import PointerRecord, make_params
from ._streams import on_stream, record_kernel_arrays
from .decode import check_num_splits, launch_decode, uses_split_path

_SM90_MAPS_BYTES = 4 * _tma.MAP_BYTES   # kernels_cu/forward_sm90.cu: ForwardSm90Maps (tests/test_compile.py holds them equal)


_BINDINGS = {name: name for name in ("q", "k", "v", "o", "lse")}   # the pointer fields a forward call fills


class ForwardPlan:
    """Everything a forward launch needs but the arrays' addresses: the kernel, its grid, block and
    shared memory, and the params record (a PointerRecord: the q, k, v, o, lse fields written per call). A plan is a
    function of the checked call (shapes, strides, dtype, options, device), so calls that repeat one
    (a training loop) reuse it: see flash_forward's plan cache."""

    def __init__(self, kernel, grid: int, threads: int, smem: int, params, lse_shape: tuple, variant,
                 maps: tuple = (), tile_counter_bytes: int = 0):
        self.kernel, self.grid, self.threads, self.smem = kernel, grid, threads, smem
        self.record, self.lse_shape = PointerRecord(params, _BINDINGS), lse_shape
        # The variant's device arrays (slopes, sink, bias as float32, cu_seqlens) that params points
        # at: held as long as the plan, so they outlive the launch. Plain plans hold none.
        self.variant_arrays = tuple(x for x in variant.device_arrays() if x is not None)
        self.maps = maps   # Hopper: _sm90_maps's (dtype, q box rows, k/v box rows, packed); else ()
        # Hopper: blocks take tiles from a counter of this size (0: they do not), one per (host
        # thread, stream).
        self._counters = TileCounters(tile_counter_bytes) if tile_counter_bytes else None
        self.device = _current_device()   # the kernel handle's
        self._launches: dict = {}   # kernel_parameters by the arrays' addresses (packed_once)

    def run(self, q, k, v, out=None):
        """Launch on kernel-ready q, k, v of the planned shapes, strides and device; returns (o, lse),
        written into ``out`` = (o, lse) where given (check_outputs' layout), else allocated."""
        import cupy

        if out is None:
            o = cupy.empty(q.shape, dtype=q.dtype)
            lse = cupy.empty(self.lse_shape, dtype=cupy.float32)
        else:
            o, lse = out
        record_kernel_arrays((q, k, v, o, lse) + self.variant_arrays)
        # A training loop's calls pack nothing (~6 us of the host time before the launch, which
        # the GPU waits for).
        parameters = packed_once(self._launches, (q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr, lse.data.ptr),
                                 lambda: self._parameters(q, k, v, o, lse))
        launch_buffers(self.kernel, self.grid, self.threads, self.smem, parameters)
        return o, lse

    def _parameters(self, q, k, v, o, lse):
        record = self.record.filled(dict(q=q, k=k, v=v, o=o, lse=lse))
        if not self.maps:
            return kernel_parameters((record,))
        counter = self._counters.address() if self._counters is not None else 0
        return kernel_parameters((_sm90_maps(q, k, v, o, *self.maps), record, ctypes.c_uint64(counter)))


def forward_plan(q, k, v, shape, scale, variant, config: tuple = ()) -> ForwardPlan:
    """The plan of a checked call on kernel-ready arrays. The family is _families.forward_family's
    choice: Hopper (wgmma) or tensor cores (mma.sync) for float16 and bfloat16, CUDA cores for
    float32; ``variant`` (a checked ``_features.Variant``) selects the instantiation by its flags.
    ``config`` (block_m, tile, block_n, stages) overrides the Hopper tile table (bench/tile_sweep.py)."""
    import cupy

    variant = variant.on_device()
    lse_shape = lse_shape_of(shape, variant)
    # The record is filled from stand-ins of o and lse (make_params reads their strides and
    # addresses); run() writes the real addresses.
    o = cupy.ndarray(q.shape, dtype=q.dtype, memptr=q.data)
    lse = cupy.ndarray(lse_shape, dtype=cupy.float32, memptr=q.data)
    params = make_params(shape, scale, variant=variant, q=q, k=k, v=v, o=o, lse=lse)
    device = _families.current_device()
    family = _families.forward_family(device, shape, variant, arrays=(q, k, v))
    if family == "forward_sm90":
        tile = _traits.forward_sm90_tile(shape.head_dim)
        kernel, smem, (block_m, _, block_n, _), threads, counter_bytes = _sm90_kernel(
            cupy.cuda.runtime.getDevice(), shape.dtype, tile, variant.flags, variant.causal,
            config or _traits.forward_sm90_config(tile, variant.flags, variant.causal, shape.seqlen_k))
        # A persistent grid where tiles cost the same, or where blocks take them from a counter;
        # else a block per tile (kernels_cu/forward_sm90.cu, TileScheduler, which states which).
        # (The tile count is below 2^31: _checks bounds the portable kernels' grid, of smaller
        # blocks, by it.)
        tiles = -(-shape.seqlen_q // block_m) * shape.batch * shape.heads
        uniform = not variant.causal and variant.window_left is None and variant.packed is None
        grid = min(tiles, device.multiprocessors) if uniform or counter_bytes else tiles
        return ForwardPlan(kernel, grid, threads, smem, params, lse_shape, variant,
                           (shape.dtype, block_m, block_n, variant.packed is not None),
                           tile_counter_bytes=counter_bytes)
    if family == "forward_tc":
        target = device.tensor_core_target
        spec = ModuleSpec("forward_tc", shape.dtype, shape.tile, target, variant.flags)
        smem = _traits.forward_tc_smem_bytes(shape.tile, target, bias=variant.bias is not None)
        if smem > _traits.TARGET_SMEM_BYTES[target]:
            raise ValueError(f"bias with head_dim {shape.head_dim} needs {smem} bytes of shared memory per block; "
                             f"this GPU allows {_traits.TARGET_SMEM_BYTES[target]} (use head_dim <= 128, or an "
                             "sm_80/sm_90-class GPU)")
        kernel = get_kernel(spec, spec.forward_tc_kernel(variant.causal), smem)
        block_m = _traits.forward_tc_block_m(shape.tile, target)
        threads = 32 * _traits.forward_tc_config(shape.tile, target)[1]   # 32 x num_warps
    else:
        spec = ModuleSpec("forward", shape.dtype, shape.tile, features=variant.flags)
        smem = _traits.forward_smem_bytes(shape.tile)
        kernel = get_kernel(spec, spec.forward_kernel(variant.causal), smem)
        block_m, _ = _traits.FORWARD_BLOCKS[shape.tile]
        threads = _traits.THREADS
    grid = -(-shape.seqlen_q // block_m) * shape.batch * shape.heads
    return ForwardPlan(kernel, grid, threads, smem, params, lse_shape, variant)


@functools.lru_cache(maxsize=None)
def _sm90_kernel(device: int, dtype: str, tile: int, flags: int, causal: bool, config: tuple):
    """(kernel, shared memory bytes, tile arguments, threads, the size of the tile counter it takes
    its tiles from or 0 where it takes none) of a Hopper forward instantiation on ``device``, looked
    up once."""
    spec = ModuleSpec("forward_sm90", dtype, tile, "sm90a", flags, config=config)
    smem = device_value(spec, spec.forward_sm90_smem())
    counter = device_value(spec, spec.tile_counter_bytes()) if device_value(spec, spec.forward_sm90_dynamic_tiles(causal)) else 0
    return (get_kernel(spec, spec.forward_sm90_kernel(causal), smem), smem, spec.config,
            _traits.forward_sm90_threads(spec.config), counter)


_maps_cache: dict = {}
_output_maps: dict = {}


def _sm90_maps(q, k, v, o, dtype: str, block_m: int, block_n: int, packed: bool):
    """The kernel's ForwardSm90Maps argument (q, k, v, o tensor maps), each cached by everything that
    enters it: repeated calls on the same buffers (a training loop) encode nothing, and an output
    whose memory the pool hands out again (the last call's o, freed) finds its map."""
    key = (q.data.ptr, q.shape, q.strides, k.data.ptr, k.shape, k.strides, v.data.ptr, v.shape, v.strides, dtype,
           block_m, block_n, packed)
    inputs = cached(_maps_cache, key, lambda: (_tma.attention_map(q, dtype, block_m, packed)
                                           + _tma.attention_map(k, dtype, block_n, packed)
                                           + _tma.attention_map(v, dtype, block_n, packed)))
    output = cached(_output_maps, (o.data.ptr, o.shape, o.strides, dtype, packed),
                    lambda: _tma.attention_map(o, dtype, _tma.STORE_ROWS, packed))
    return ctypes.create_string_buffer(inputs + output, _SM90_MAPS_BYTES)


@on_stream
def flash_forward(q, k, v, *, softmax_scale=None, causal=False, num_splits=None, **features):
    """Exact attention ``softmax(softmax_scale * q k^T) v`` without materialising the scores.

    q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim) with
    heads_q a multiple of heads_kv (MQA/GQA); float16, bfloat16 (``ml_dtypes.bfloat16``) or
    float32, head_dim a multiple of 8 up to 256. CuPy arrays, or GPU arrays of other frameworks
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
    is computed. Not combined with ``bias``.

    Split-KV: with float16/bfloat16, when each K/V head has few query rows (group x seqlen_q <= 32,
    e.g. decoding) the keys are split into ranges computed in parallel and merged exactly
    (``num_splits``: how many; default chosen from the SM count and the work; giving it takes this
    path whenever the variant allows: not with bias or packed batches).

    Returns ``(o, lse)``: o like q; lse float32 (batch, heads_q, seqlen_q) (packed: (heads_q,
    total_q)), the natural-log logsumexp of the logits (the sink included), -inf (with o = 0) for
    a row that sees no key.
    """
    # forward_into's body: this wrapper has taken the stream (a second wrapper costs ~1 us of the
    # host time before the launch)
    return forward_into.__wrapped__(None, q, k, v, softmax_scale=softmax_scale, causal=causal,
                                    num_splits=num_splits, **features)


@on_stream
def forward_into(out, q, k, v, *, softmax_scale=None, causal=False, num_splits=None, **features):
    """flash_forward writing into ``out`` = (o, lse), C-contiguous GPU arrays of the output shapes
    and dtypes on q's device (None: allocated): the adapters hand over their framework's buffers.
    No checks are skipped; ``out`` is checked after the inputs, before any launch."""
    key = _plan_key(q, k, v, softmax_scale, causal) if not features and num_splits is None else None
    if key is not None:
        plan = _plans.get(key)
        if plan is not None and plan.device == _current_device():
            return plan.run(q, k, v, check_outputs(out, plan.lse_shape, q))
    _checks.check_no_extra_options("flash_forward", features)
    num_splits = check_num_splits(num_splits)
    given = (q, k, v)
    q, k, v, shape, scale, variant = _checks.prepare_qkv(q, k, v, softmax_scale, causal, features)
    with q.device:
        _checks.same_device(q=q, k=k, v=v)
        q, k, v = (_checks.kernel_ready(x) for x in (q, k, v))
        out = check_outputs(out, lse_shape_of(shape, variant), q)
        if uses_split_path(shape, variant, num_splits):
            return launch_decode(q, k, v, shape, scale, variant, num_splits, out=out)
        plan = forward_plan(q, k, v, shape, scale, variant)
        if key is not None and all(x is y for x, y in zip((q, k, v), given)):   # checked, and no copy made
            kept(_plans, key, plan)
        return plan.run(q, k, v, out)


def lse_shape_of(shape, variant) -> tuple:
    """(batch, heads_q, seqlen_q), or (heads_q, total_q) for a packed batch."""
    return (shape.batch, shape.heads, shape.seqlen_q) if variant.packed is None else (shape.heads, variant.packed.total_q)


def check_outputs(out, lse_shape: tuple, q):
    """``out`` = (o, lse) as CuPy views (None: None), or ValueError naming the one that does not fit:
    o like q (shape and dtype), lse float32 of ``lse_shape``, both C-contiguous on q's device."""
    if out is None:
        return None
    device = q.data.device_id
    return (_checks.output_buffer("o", out[0], q.shape, q.dtype, device),
            _checks.output_buffer("lse", out[1], lse_shape, "float32", device))


# Plans of plain calls (no feature keywords) that passed the checks with q, k, v readable as they
# are, by everything the checks and the plan read: a repeated call skips both (~100 us of Python
# on the H100's host; bench/host_overhead.py). A key holds no array: only shapes, strides, dtypes,
# address alignments and device ids, the scale and causal (with their types: True == 1.0 in a
# dict), and the kernels setting.
_plans: dict = {}


@contextlib.contextmanager
def plain_causal_tiles_from(keys: int):
    """Inside: plain causal Hopper forward calls take _traits.FORWARD_SM90_PLAIN's tiles from ``keys``
    keys instead of FORWARD_SM90_PLAIN_CAUSAL_MIN_KEYS (the GPU tests and the sanitizer workload, so
    short causal calls run both tile shapes). A plan's key does not hold the rule, so the plans made
    under either are dropped on the way in and out."""
    thresholds = _traits.FORWARD_SM90_PLAIN_CAUSAL_MIN_KEYS
    saved = dict(thresholds)
    _plans.clear()
    thresholds.update(dict.fromkeys(saved, keys))
    try:
        yield
    finally:
        thresholds.update(saved)
        _plans.clear()


def _plan_key(q, k, v, softmax_scale, causal):
    ndarray = _cupy_ndarray()
    if type(q) is not ndarray or type(k) is not ndarray or type(v) is not ndarray:
        return None
    q_data, k_data, v_data = q.data, k.data, v.data
    return (q.shape, q.strides, q.dtype, q_data.ptr % 16, q_data.device_id,
            k.shape, k.strides, k.dtype, k_data.ptr % 16, k_data.device_id,
            v.shape, v.strides, v.dtype, v_data.ptr % 16, v_data.device_id,
            type(softmax_scale), softmax_scale, type(causal), causal, _families.kernels_setting())


@functools.lru_cache(maxsize=None)
def _cupy_ndarray():
    import cupy

    return cupy.ndarray


def _current_device() -> int:
    import cupy

    return cupy.cuda.runtime.getDevice()


@on_stream
def flash_attention(q, k, v, **options):
    """``flash_forward(...)[0]``: the attention output only."""
    return flash_forward(q, k, v, **options)[0]
