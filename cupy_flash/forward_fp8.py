"""The FP8 forward's launch: ``flash_forward`` on e4m3 q, k, v (uint8 bits, ``quantize_fp8``'s) with
their descales, on Hopper (kernels_cu/forward_sm90.cu with T = fa_e4m3; docs/fp8.md).

A call writes V^T once (fp8_transpose_v: the e4m3 P V product reads V K-major), then runs the
forward; O is bfloat16, lse float32 as for every forward."""

from __future__ import annotations

import ctypes
import threading

import numpy

from . import _checks, _tma, _traits, families
from ._dtypes import bfloat16
from ._launch import Packed, TileCounters, cached, current_stream, kept
from ._params import PointerRecord, make_params
from ._streams import record_kernel_arrays
from .families import sm90
from .fp8 import check_fp8_call

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
    CuPy arrays that repeats a checked one (its shapes, strides, alignment, device, scale and causal)
    takes that call's plan: only the descales are checked again (their values change)."""
    features = dict(features)
    descales = {name: features.pop(name, None) for name in DESCALES}
    # Descales on the host are checked there (no synchronisation) and copied; GPU ones are read back.
    descales = {name: x if x is None or isinstance(x, numpy.ndarray) else _checks.as_gpu_array(name, x)
                for name, x in descales.items()}
    key = _plan_key(q, k, v, softmax_scale, causal, descales) if not features else None
    plan = _plans.get(key) if key is not None else None
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


def _checked_plan(q, k, v, softmax_scale, causal, descales: dict, features: dict):
    """(plan, q, k, v kernel-ready) of an FP8 call whose FP8 data check_fp8_call passed: its shapes,
    scale, variant and device checked."""
    q, k, v, shape, scale, variant = _checks.prepare_qkv(q, k, v, softmax_scale, causal, features, fp8=True)
    with q.device:
        _checks.same_device(q=q, k=k, v=v, **{name: x for name, x in descales.items() if not isinstance(x, numpy.ndarray)})
        device = families.current_device()
        if not sm90.ForwardFp8.supports(device, shape, variant, families.kernels_setting()):
            raise ValueError(f"FP8 attention runs on the Hopper kernels (compute capability 9.0, head_dim <= "
                             f"{max(sm90.FORWARD_SM90_FP8)}); this GPU has compute capability "
                             f"{device.compute_capability / 10:.1f}")
        q, k, v = (_checks.kernel_ready(x) for x in (q, k, v))
        return Fp8ForwardPlan(device, shape, scale, variant.on_device(), q, k, v), q, k, v


class Fp8ForwardPlan:
    """An FP8 forward call's checked shape, variant, kernels and params record (its pointer fields
    written per call): it launches V^T's pass, then the forward, on kernel-ready arrays."""

    def __init__(self, device, shape, scale: float, variant, q, k, v):
        import cupy

        self.shape, self.variant = shape, variant
        self.transpose, self.main, counter_bytes = sm90.ForwardFp8.forward_launch(device, shape, variant)
        self.counters = cached(_counters, counter_bytes, lambda: TileCounters(counter_bytes)) if counter_bytes else None
        group = _traits.FP8_KEY_GROUP
        self.packed = variant.packed
        if self.packed is None:
            self.keys = -(-shape.seqlen_k // group) * group
            self.vt_shape = (shape.batch, shape.heads_kv, shape.head_dim, self.keys)
            self.lse_shape = (shape.batch, shape.heads, shape.seqlen_q)
            self.vt_rows, self.sequences = None, 0
        else:   # each sequence's keys from a row of V^T of its own, a multiple of 32
            rows = numpy.diff(numpy.asarray(self.packed.host_cu_seqlens_k, dtype=numpy.int64))
            vt_rows = numpy.concatenate([[0], numpy.cumsum(-(-rows // group) * group)])
            self.keys = max(int(vt_rows[-1]), group)
            self.vt_shape = (1, shape.heads_kv, shape.head_dim, self.keys)
            self.lse_shape = (shape.heads, self.packed.total_q)
            self.vt_rows, self.sequences = cupy.asarray(vt_rows.astype(numpy.int32)), shape.batch
        self.tile = sm90.forward_sm90_fp8_tile(shape.head_dim)
        # Stand-ins for o and lse: make_params reads their strides; run() writes every address.
        o, lse = cupy.empty(q.shape, dtype=bfloat16()), cupy.empty(self.lse_shape, dtype=cupy.float32)
        params = make_params(shape, scale, variant=variant, q=q, k=k, v=v, o=o, lse=lse, vt_rows=self.vt_rows)
        self.record = PointerRecord(params, {name: name for name in _RECORD_ARRAYS})
        self._encoded_maps: dict = {}   # the maps by the q, k, V^T, o addresses

    def _maps(self, q, k, vt, o):
        """The kernel's ForwardSm90Maps, by the arrays' addresses (their layouts are the plan's): q
        and k (e4m3, boxes of 128 bytes x the query / key block), V^T (boxes of 128 keys x the
        head-dim tile, 128-byte swizzled where key blocks are whole 128-key rows, else of 64 keys,
        64-byte swizzled: VtChunk in forward_sm90.cu) and o (bfloat16, the store box)."""
        def encode():
            tile = self.tile
            block_m, block_n, _ = sm90.FORWARD_SM90_FP8[tile]
            vt_keys = 128 if block_n % 128 == 0 else 64
            batch, heads_kv, head_dim, keys = vt.shape
            vt_map = _tma.encode_tiled("uint8", vt.data.ptr, (keys, head_dim, heads_kv, batch),
                                       (keys, head_dim * keys, heads_kv * head_dim * keys), (vt_keys, tile, 1, 1),
                                       _tma.SWIZZLE_128B if vt_keys == 128 else _tma.SWIZZLE_64B)
            packed = self.packed is not None
            return (_tma.attention_map_at(q.data.ptr, _tma.layout_of(q), "uint8", block_m, packed)
                    + _tma.attention_map_at(k.data.ptr, _tma.layout_of(k), "uint8", block_n, packed)
                    + vt_map + _tma.attention_map_at(o.data.ptr, _tma.layout_of(o), "bfloat16", _tma.STORE_ROWS, packed))

        addresses = (q.data.ptr, k.data.ptr, vt.data.ptr, o.data.ptr)
        return ctypes.create_string_buffer(cached(self._encoded_maps, addresses, encode), 4 * _tma.MAP_BYTES)

    def run(self, q, k, v, descales: dict, out=None):
        """(o, lse) of kernel-ready q, k, v of the planned shapes with their checked descales, into
        ``out`` where given (checked here)."""
        import cupy

        shape = self.shape
        if out is not None:
            out = (_checks.output_buffer("o", out[0], q.shape, bfloat16(), q.data.device_id),
                   _checks.output_buffer("lse", out[1], self.lse_shape, "float32", q.data.device_id))
        q_descale, k_descale, v_descale = descales_on_device(descales)
        if q_descale.shape[1] != shape.heads:   # per K/V head: each query head of its group takes it
            q_descale = cupy.repeat(q_descale, shape.group, axis=1)
        o, lse = out if out is not None else (cupy.empty(q.shape, dtype=bfloat16()),
                                              cupy.empty(self.lse_shape, dtype=cupy.float32))
        vt = cupy.empty(self.vt_shape, dtype=cupy.uint8)
        arrays = dict(q=q, k=k, v=v, o=o, lse=lse, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
        record = self.record.filled({name: x.data.ptr for name, x in arrays.items()})
        record_kernel_arrays(tuple(arrays.values()) + (vt,) + tuple(x for x in self.variant.device_arrays() if x is not None))
        stream, capturing = current_stream()
        strides = v.strides[:3] if self.packed is None else (0, *v.strides[:2])   # bytes: uint8
        packed = (0, 0, 0) if self.packed is None else (self.packed.cu_seqlens_k.data.ptr, self.vt_rows.data.ptr, self.sequences)
        values = (v.data.ptr, *strides, shape.heads_kv, shape.seqlen_k, shape.head_dim, vt.data.ptr, self.keys, *packed)
        transpose_arguments = tuple(kind(value) for kind, value in zip(TRANSPOSE_PARAMETERS, values))
        transpose_grid = -(-self.keys // _traits.FP8_TRANSPOSE_KEYS) * self.vt_shape[0] * shape.heads_kv
        counter = self.counters.address(stream, capturing) if self.counters is not None else 0
        maps = self._maps(q, k, vt, o)
        transpose, main = self.transpose, self.main
        launches = ((transpose.kernel, transpose_grid, transpose.threads, 0, transpose_arguments, False),
                    (main.kernel, main.grid, main.threads, main.smem, (maps, record, ctypes.c_uint64(counter)), False))
        Packed(launches, stream, (sm90.ForwardFp8.name, (transpose.name, main.name))).run()
        return o, lse


def descales_on_device(descales: dict) -> tuple:
    """The three descales as contiguous float32 GPU arrays, in DESCALES' order. Host ones go up in
    one copy from pinned memory, which does not wait for the stream (a copy from pageable memory
    does: it held each call until the GPU had finished the last)."""
    import cupy

    stream = cupy.cuda.get_current_stream()
    if all(isinstance(descales[name], numpy.ndarray) for name in DESCALES) and not stream.is_capturing():
        host = [numpy.asarray(descales[name], dtype=numpy.float32) for name in DESCALES]
        uploads = getattr(_pinned_uploads, "uploads", None)
        if uploads is None:
            uploads = _pinned_uploads.uploads = PinnedUploads()
        joined = uploads.upload(numpy.concatenate([x.ravel() for x in host]), stream)
        views, start = [], 0
        for x in host:
            views.append(joined[start:start + x.size].reshape(x.shape))
            start += x.size
        return tuple(views)
    return tuple(cupy.ascontiguousarray(cupy.asarray(descales[name], dtype=cupy.float32)) for name in DESCALES)


class PinnedUploads:
    """Small host arrays to the GPU on a stream without waiting for it (one host thread's): each is
    copied into a pinned buffer, then to a new device array by an asynchronous copy; a buffer is
    reused once the event recorded after its copy has completed. With MAX_BUFFERS in flight, the
    oldest copy is waited for."""

    MAX_BUFFERS = 64

    def __init__(self):
        self._buffers: list = []   # (pinned memory, bytes, event of its last copy)

    def upload(self, host: numpy.ndarray, stream):
        import cupy

        index = next((i for i, (_, size, event) in enumerate(self._buffers)
                      if size >= host.nbytes and (event is None or event.done)), None)
        if index is None and len(self._buffers) >= self.MAX_BUFFERS:   # the oldest copy, waited for
            memory, size, event = self._buffers.pop(0)
            event.synchronize()
            if size >= host.nbytes:
                self._buffers.append((memory, size, None))
                index = len(self._buffers) - 1
        if index is None:
            self._buffers.append((cupy.cuda.alloc_pinned_memory(max(host.nbytes, 4096)), max(host.nbytes, 4096), None))
            index = len(self._buffers) - 1
        memory, size, _ = self._buffers[index]
        staged = numpy.frombuffer(memory, dtype=host.dtype, count=host.size).reshape(host.shape)
        staged[...] = host
        device = cupy.empty(host.shape, dtype=host.dtype)
        device.set(staged, stream=stream)
        event = cupy.cuda.Event(block=False, disable_timing=True)
        event.record(stream)
        self._buffers[index] = (memory, size, event)
        return device


_pinned_uploads = threading.local()   # .uploads: this thread's PinnedUploads
_RECORD_ARRAYS = ("q", "k", "v", "o", "lse", "q_descale", "k_descale", "v_descale")
# Plans of FP8 calls without variant keywords, by what their checks read (a key holds no array).
_plans: dict = {}


def _plan_key(q, k, v, softmax_scale, causal, descales: dict):
    import cupy

    if type(q) is not cupy.ndarray or type(k) is not cupy.ndarray or type(v) is not cupy.ndarray:
        return None
    return (q.shape, q.strides, k.shape, k.strides, v.shape, v.strides, q.dtype, k.dtype, v.dtype,
            (q.data.ptr | k.data.ptr | v.data.ptr) & 15, q.data.device_id, k.data.device_id, v.data.device_id,
            type(softmax_scale), softmax_scale, type(causal), causal, families.kernels_setting(),
            tuple((type(x), getattr(x, "shape", None), getattr(getattr(x, "data", None), "device_id", None))
                  for x in descales.values()))


