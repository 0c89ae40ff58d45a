"""The FP8 forward's launch: ``flash_forward`` on e4m3 q, k, v (uint8 bits, ``quantize_fp8``'s) with
their descales, on Hopper (kernels_cu/forward_sm90.cu with T = fa_e4m3; docs/fp8.md).

A call writes V^T once (fp8_transpose_v: the e4m3 P V product reads V K-major), then runs the
forward; O is bfloat16, lse float32 as for every forward."""

from __future__ import annotations

import ctypes
import threading
import typing

import numpy

from . import _checks, _tma, _traits, families
from ._dtypes import bfloat16
from ._launch import (
    OutputAndLse,
    Packed,
    TileCounters,
    cached,
    cuda_calls,
    current_stream,
    kept,
    packed_once,
    ready_stream,
    short_call_workspace,
)
from ._params import PointerRecord, make_params
from ._streams import record_kernel_arrays
from .families import sm90
from .fp8 import check_fp8_call, descales_trusted

DESCALES = ("q_descale", "k_descale", "v_descale")
# fp8_transpose_v's parameters (kernels_cu/forward_sm90.cu; tests/test_compile.py holds them equal):
# v, its batch, row and head strides, heads_kv, seqlen_k, head_dim, vt, keys; packed batches:
# cu_seqlens_k, vt_rows and the sequences (else 0).
TRANSPOSE_PARAMETERS = (ctypes.c_uint64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32,
                        ctypes.c_int32, ctypes.c_uint64, ctypes.c_int32, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int32)
_counters: dict = {}   # TileCounters by size


def is_fp8_call(q, features: dict) -> bool:
    """Whether a flash_forward call is an FP8 one: q holds uint8 bits, or a descale is given."""
    return getattr(q, "dtype", None) == numpy.uint8 or any(features.get(name) is not None for name in DESCALES)


def forward_fp8(out, q, k, v, softmax_scale, causal, features: dict):
    """flash_forward's FP8 call (``out``: forward_into's), checked before any launch: (o bfloat16
    like q's shape, lse float32 (batch, heads_q, seqlen_q)). A call without variant keywords on
    CuPy arrays that repeats a checked one (its shapes, strides, alignment, device, scale, causal
    and its descales' kinds, shapes and dtypes) takes that call's plan: only the descales' values
    are checked again (they change); with host descales, on Fp8ForwardPlan.call's short path."""
    features = dict(features)
    descales = popped_descales(features)
    key = _plan_key(q, k, v, softmax_scale, causal, descales) if not features else None
    plan = _plans.get(key) if key is not None else None
    if plan is not None and out is None:
        result = plan.call(q, k, v, descales)
        if result is not None:
            return result
    if plan is None:
        _checks.check_no_extra_options("flash_forward", features)
        q, k, v = (_checks.as_gpu_array(name, x) for name, x in (("q", q), ("k", k), ("v", v)))
    check_fp8_call("flash_forward", dict(q=q, k=k, v=v), descales, features)
    if plan is None:
        given = (q, k, v)
        plan, q, k, v = _checked_plan(q, k, v, softmax_scale, causal, descales, features)
        if key is not None and all(x is y for x, y in zip((q, k, v), given)):   # read in place: no copy made
            kept(_plans, key, plan)
    with q.device:
        return plan.run(q, k, v, descales, out)


def popped_descales(features: dict) -> dict:
    """The descales popped from ``features``: host (NumPy) ones as they are (checked there, without
    a synchronisation, and copied), others as GPU arrays (read back to be checked)."""
    descales = {name: features.pop(name, None) for name in DESCALES}
    return {name: x if x is None or isinstance(x, numpy.ndarray) else _checks.as_gpu_array(name, x)
            for name, x in descales.items()}


def _checked_plan(q, k, v, softmax_scale, causal, descales: dict, features: dict):
    """(plan, q, k, v kernel-ready) of an FP8 call whose FP8 data check_fp8_call passed: its shapes,
    scale, variant and device checked."""
    q, k, v, shape, scale, variant = _checks.prepare_qkv(q, k, v, softmax_scale, causal, features, fp8=True)
    with q.device:
        _checks.same_device(q=q, k=k, v=v, **{name: x for name, x in descales.items() if not isinstance(x, numpy.ndarray)})
        device = families.current_device()
        if not sm90.ForwardFp8.supports(device, shape, variant, families.kernels_setting()):
            raise ValueError(f"FP8 attention runs on the Hopper kernels (compute capability 9.0, head_dim <= "
                             f"{max(sm90.FORWARD_SM90_FP8)}); this call has head_dim {shape.head_dim} on a GPU of "
                             f"compute capability {device.compute_capability / 10:.1f}")
        q, k, v = (_checks.kernel_ready(x) for x in (q, k, v))
        return Fp8ForwardPlan(device, shape, scale, variant.on_device(), q, k, v), q, k, v


class Fp8ForwardPlan(OutputAndLse):
    """An FP8 forward call's checked shape, variant, kernels and params record (its pointer fields
    written per call): it launches V^T's pass, then the forward, on kernel-ready arrays. Its
    launches are packed once per set of addresses (packed_once), as the bf16 forward's are."""

    def __init__(self, device, shape, scale: float, variant, q, k, v):
        import cupy

        self.cuda = cuda_calls()
        self.device = self.cuda.get_device()
        self.shape, self.variant = shape, variant
        self.transpose, self.main, counter_bytes = sm90.ForwardFp8.forward_launch(device, shape, variant)
        self.counters = cached(_counters, counter_bytes, lambda: TileCounters(counter_bytes)) if counter_bytes else None
        group = _traits.FP8_KEY_GROUP
        self.packed = variant.packed
        if self.packed is None:
            self.keys = -(-shape.seqlen_k // group) * group
            self.vt_shape = (shape.batch, shape.heads_kv, shape.head_dim, self.keys)
            lse_shape = (shape.batch, shape.heads, shape.seqlen_q)
            self.vt_rows, self.sequences = None, 0
        else:   # each sequence's keys from a row of V^T of its own, a multiple of 32
            rows = numpy.diff(numpy.asarray(self.packed.host_cu_seqlens_k, dtype=numpy.int64))
            vt_rows = numpy.concatenate([[0], numpy.cumsum(-(-rows // group) * group)])
            self.keys = max(int(vt_rows[-1]), group)
            self.vt_shape = (1, shape.heads_kv, shape.head_dim, self.keys)
            lse_shape = (shape.heads, self.packed.total_q)
            self.vt_rows, self.sequences = cupy.asarray(vt_rows.astype(numpy.int32)), shape.batch
        self.vt_bytes = int(numpy.prod(self.vt_shape))
        self.tile = sm90.forward_sm90_fp8_tile(shape.head_dim)
        # Stand-ins for o and lse: make_params reads their strides, the maps o's layout; every
        # address is written per call.
        o = cupy.empty(q.shape, dtype=bfloat16())
        self.plan_outputs(o, lse_shape)
        params = make_params(shape, scale, variant=variant, q=q, k=k, v=v, o=o,
                             lse=cupy.empty(lse_shape, dtype=cupy.float32), vt_rows=self.vt_rows)
        self.record = PointerRecord(params, {name: name for name in _RECORD_ARRAYS})
        self.layouts = (_tma.layout_of(q), _tma.layout_of(k), _tma.layout_of(o))
        self.v_strides = v.strides[:3] if self.packed is None else (0, *v.strides[:2])   # bytes: uint8
        self.variant_arrays = tuple(x for x in variant.device_arrays() if x is not None)
        self._encoded_maps: dict = {}   # the maps by the q, k, V^T, o addresses
        self._launches: dict = {}       # Packed by the arrays' addresses, stream and thread (packed_once)

    def call(self, q, k, v, descales: dict):
        """The repeated plain call (forward_fp8's plan cache found this plan) with descales the
        short path takes (short_path_descales): (o, lse) in new arrays, V^T in the stream's kept
        workspace where it fits; or None where the checked route must take it (GPU descales outside
        trusted_descales, whose read-back that route makes; a descale value to refuse, which it
        names; another current device; a capturing stream)."""
        stream = ready_stream(self)
        if stream is None:
            return None
        uploaded = short_path_descales(descales, self.shape.heads, stream)
        if uploaded is None:
            return None
        o, lse = self.outputs()
        vt_at, _vt = short_call_workspace(self.vt_bytes, self.device, stream, self.cuda.alloc)   # held until launched
        self.launch((q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr, lse.data.ptr) + uploaded.addresses + (vt_at,),
                    stream, False)
        uploaded.launched(stream)
        return o, lse

    def run(self, q, k, v, descales: dict, out=None):
        """(o, lse) of kernel-ready q, k, v of the planned shapes with their checked descales, into
        ``out`` where given (checked here)."""
        import cupy

        if out is not None:
            out = (_checks.output_buffer("o", out[0], q.shape, bfloat16(), q.data.device_id),
                   _checks.output_buffer("lse", out[1], self.lse_shape, "float32", q.data.device_id))
        stream, capturing = current_stream()
        uploaded = upload_descales(descales, self.shape.heads, stream, capturing)
        o, lse = out if out is not None else self.outputs()
        vt = cupy.empty(self.vt_shape, dtype=cupy.uint8)
        record_kernel_arrays((q, k, v, o, lse, vt) + uploaded.held + self.variant_arrays)
        self.launch((q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr, lse.data.ptr) + uploaded.addresses + (vt.data.ptr,),
                    stream, capturing)
        uploaded.launched(stream)
        return o, lse

    def launch(self, addresses: tuple, stream: int, capturing: bool) -> None:
        """V^T's pass and the forward with q, k, v, o, lse, the three descales and V^T at
        ``addresses`` on the stream at ``stream``."""
        packed_once(self._launches, addresses, stream, capturing,
                    lambda: self._packed(addresses, stream, capturing)).run()

    def _packed(self, addresses: tuple, stream: int, capturing: bool) -> Packed:
        shape = self.shape
        q_at, k_at, v_at, o_at = addresses[:4]
        vt_at = addresses[-1]
        record = self.record.filled(dict(zip(_RECORD_ARRAYS, addresses)))
        packed = (0, 0, 0) if self.packed is None else (self.packed.cu_seqlens_k.data.ptr, self.vt_rows.data.ptr, self.sequences)
        values = (v_at, *self.v_strides, shape.heads_kv, shape.seqlen_k, shape.head_dim, vt_at, self.keys, *packed)
        transpose_arguments = tuple(kind(value) for kind, value in zip(TRANSPOSE_PARAMETERS, values))
        transpose_grid = -(-self.keys // _traits.FP8_TRANSPOSE_KEYS) * self.vt_shape[0] * shape.heads_kv
        counter = self.counters.address(stream, capturing) if self.counters is not None else 0
        maps = self._maps(q_at, k_at, vt_at, o_at)
        transpose, main = self.transpose, self.main
        launches = ((transpose.kernel, transpose_grid, transpose.threads, 0, transpose_arguments, False),
                    (main.kernel, main.grid, main.threads, main.smem, (maps, record, ctypes.c_uint64(counter)), False))
        return Packed(launches, stream, (sm90.ForwardFp8.name, (transpose.name, main.name)))

    def _maps(self, q_at: int, k_at: int, vt_at: int, o_at: int):
        """The kernel's ForwardSm90Maps, by the arrays' addresses (their layouts are the plan's): q
        and k (e4m3, boxes of 128 bytes, 64 at the 64 tile, x the query / key block), V^T (boxes of 128 keys x the
        head-dim tile, 128-byte swizzled where key blocks are whole 128-key rows, else of 64 keys,
        64-byte swizzled: VtChunk in forward_sm90.cu) and o (bfloat16, the store box)."""
        def encode():
            tile = self.tile
            block_m, block_n, _ = sm90.FORWARD_SM90_FP8[tile]
            vt_keys = 128 if block_n % 128 == 0 else 64
            batch, heads_kv, head_dim, keys = self.vt_shape
            vt_map = _tma.encode_tiled("uint8", vt_at, (keys, head_dim, heads_kv, batch),
                                       (keys, head_dim * keys, heads_kv * head_dim * keys), (vt_keys, tile, 1, 1),
                                       _tma.SWIZZLE_128B if vt_keys == 128 else _tma.SWIZZLE_64B)
            packed = self.packed is not None
            q_layout, k_layout, o_layout = self.layouts
            row_bytes = min(tile, _tma.SWIZZLE_BYTES)   # e4m3 rows: 128 bytes, or the 64 of d <= 64's tile
            return (_tma.attention_map_at(q_at, q_layout, "uint8", block_m, packed, row_bytes)
                    + _tma.attention_map_at(k_at, k_layout, "uint8", block_n, packed, row_bytes)
                    + vt_map + _tma.attention_map_at(o_at, o_layout, "bfloat16", _tma.STORE_ROWS, packed))

        addresses = (q_at, k_at, vt_at, o_at)
        return ctypes.create_string_buffer(cached(self._encoded_maps, addresses, encode), _tma.FORWARD_MAPS_BYTES)


class UploadedDescales(typing.NamedTuple):
    """upload_descales' result: the q, k, v descales' addresses (float32 on the GPU, q's per query
    head), what holds their memory, and the ring slot they occupy (None: arrays of their own)."""

    addresses: tuple
    held: tuple
    ring: object = None
    slot: int | None = None

    def launched(self, stream: int) -> None:
        """Call once the launches that read the descales are queued on the stream at ``stream``."""
        if self.ring is not None:
            self.ring.launched(self.slot, stream)


def upload_descales(descales: dict, heads: int, stream: int, capturing: bool) -> UploadedDescales:
    """Checked descales (check_fp8_call's) on the GPU for launches on the stream at ``stream``. Host
    ones go up through this thread's DescaleRing, without waiting for the stream (on a capturing
    stream the checks refuse them: a captured copy would read the pinned slot when replayed,
    rewritten by then); GPU ones as contiguous float32 arrays, q's repeated per query head."""
    import cupy

    if not capturing and all(type(descales[name]) is numpy.ndarray for name in DESCALES):
        uploaded = _staged(descales, heads, stream)
        if uploaded is None:
            raise ValueError("a descale holds a value that is not finite and positive in float32")
        return uploaded
    arrays = [cupy.ascontiguousarray(cupy.asarray(descales[name], dtype=cupy.float32)) for name in DESCALES]
    if arrays[0].shape[1] != heads:   # per K/V head: each query head of its group takes it
        arrays[0] = cupy.repeat(arrays[0], heads // arrays[0].shape[1], axis=1)
    return UploadedDescales(tuple(x.data.ptr for x in arrays), tuple(arrays))


def short_path_descales(descales: dict, heads: int, stream: int) -> UploadedDescales | None:
    """The descales of a repeated call's short path on the stream at ``stream``, or None where the
    checked route must take them: host ones staged in this thread's DescaleRing (None: a value to
    refuse); GPU ones inside trusted_descales (fp8.py) only, as they are where they are float32,
    C-contiguous and q's per query head (the plan key held their shapes, dtypes and device)."""
    if all(type(descales[name]) is numpy.ndarray for name in DESCALES):
        return _staged(descales, heads, stream)
    if not descales_trusted():
        return None
    import cupy

    arrays = tuple(descales[name] for name in DESCALES)
    if any(type(x) is not cupy.ndarray or x.dtype != numpy.float32 or not x.flags.c_contiguous for x in arrays) \
            or arrays[0].shape[1] != heads:
        return None
    return UploadedDescales(tuple(x.data.ptr for x in arrays), arrays)


def _staged(descales: dict, heads: int, stream: int) -> UploadedDescales | None:
    """Host descales staged in this thread's DescaleRing and copied up on the stream at ``stream``;
    None (nothing queued) where a value is not finite and positive in float32."""
    ring = descale_ring(descales, heads)
    slot = ring.stage(descales, heads, stream)
    return None if slot is None else UploadedDescales(ring.addresses(slot), (), ring, slot)


class DescaleRing:
    """Host descales to the GPU for one host thread's calls of one size, without waiting for the
    stream (a copy from pageable memory waits for it): SLOTS slots of pinned and of GPU memory,
    each the three descales (float32, q's per query head) in one copy. A slot is taken again once
    the event recorded after the launches that read it has completed; with none free, the next is
    waited for. Values are checked on the staged float32 copy (not finite and positive: refused)."""

    SLOTS = 8

    def __init__(self, sizes: tuple):
        import cupy

        self.sizes = sizes
        self.total = sum(sizes)
        self.stride = -(-self.total // 64) * 64   # floats a slot: 256-byte aligned
        count = self.SLOTS * self.stride
        self.pinned = cupy.cuda.alloc_pinned_memory(4 * count)
        self.host = numpy.frombuffer(self.pinned, dtype=numpy.float32, count=count).reshape(self.SLOTS, self.stride)
        self.device = cupy.empty(count, dtype=cupy.float32)
        self.events = [cupy.cuda.Event(block=False, disable_timing=True) for _ in range(self.SLOTS)]
        self.recorded = [False] * self.SLOTS
        self.next = 0
        self.copy = cupy.cuda.runtime.memcpyAsync
        self.record = cupy.cuda.runtime.eventRecord

    def stage(self, descales: dict, heads: int, stream: int) -> int | None:
        """The slot holding the descales, their copy queued on the stream at ``stream``; None (nothing
        queued) where a value is not finite and positive in float32."""
        slot = self._free_slot()
        q_descale = descales["q_descale"]
        if q_descale.shape[1] != heads:
            q_descale = numpy.repeat(q_descale, heads // q_descale.shape[1], axis=1)
        values = self.host[slot, :self.total]
        with numpy.errstate(over="ignore"):   # past float32's range: inf, refused below
            numpy.concatenate((q_descale.ravel(), descales["k_descale"].ravel(), descales["v_descale"].ravel()),
                              out=values, casting="same_kind")
        if not (values.min() > 0 and values.max() < numpy.inf):   # NaN fails both
            return None
        offset = 4 * slot * self.stride
        self.copy(self.device.data.ptr + offset, self.host.ctypes.data + offset, 4 * self.total, 1, stream)   # host to device
        return slot

    def addresses(self, slot: int) -> tuple:
        first = self.device.data.ptr + 4 * slot * self.stride
        return first, first + 4 * self.sizes[0], first + 4 * (self.sizes[0] + self.sizes[1])

    def launched(self, slot: int, stream: int) -> None:
        self.record(self.events[slot].ptr, stream)
        self.recorded[slot] = True

    def _free_slot(self) -> int:
        for step in range(self.SLOTS):
            slot = (self.next + step) % self.SLOTS
            if not self.recorded[slot] or self.events[slot].done:
                break
        else:
            slot = self.next
            self.events[slot].synchronize()
        self.next = (slot + 1) % self.SLOTS
        return slot


def descale_ring(descales: dict, heads: int) -> DescaleRing:
    """This host thread's DescaleRing for descales of these sizes (on the current device)."""
    import cupy

    k_descale = descales["k_descale"]
    sizes = (k_descale.shape[0] * heads, k_descale.size, descales["v_descale"].size)
    rings = _rings.__dict__.setdefault("by_size", {})
    key = sizes + (cupy.cuda.runtime.getDevice(),)
    ring = rings.get(key)
    return ring if ring is not None else kept(rings, key, DescaleRing(sizes), limit=16)


_rings = threading.local()   # .by_size: this thread's DescaleRings by (sizes, device)
_RECORD_ARRAYS = ("q", "k", "v", "o", "lse", "q_descale", "k_descale", "v_descale")
# Plans of FP8 calls without variant keywords, by what their checks read (a key holds no array).
_plans: dict = {}


def _plan_key(q, k, v, softmax_scale, causal, descales: dict):
    key = _checks.qkv_key(q, k, v, softmax_scale, causal, families.kernels_setting())
    return None if key is None else key + tuple(
        (type(x), getattr(x, "shape", None), getattr(x, "dtype", None), getattr(getattr(x, "data", None), "device_id", None))
        for x in descales.values())


