"""The FP8 backward's launch code: ``flash_backward`` on e4m3 q, k, v (uint8 bits with their
descales, as ``flash_forward`` took them; docs/fp8.md, "The backward").

The gradients are those of attention over the dequantised inputs (q x q_descale, ...), in
bfloat16: the straight-through gradients a model that quantises its q, k, v wants. The products
run on bfloat16 tensor cores: fp8_dequantize_kernel (kernels_cu/preprocess.cu) writes q, k, v
times their descales in bfloat16, and the bfloat16 backward runs on them with the FP8 forward's o
and lse. Every check runs before the first launch."""

from __future__ import annotations

import ctypes

import numpy

from . import _checks
from ._dtypes import bfloat16
from ._launch import Packed, current_stream
from ._streams import record_kernel_arrays
from .families import rows
from .forward_fp8 import DESCALES, upload_descales
from .fp8 import check_fp8_call

# fp8_dequantize_kernel's parameters (tests/test_compile.py holds them equal): x, its batch, row and
# head strides (bytes), batch, rows, heads, head_dim, descale, descale_heads, cu_seqlens, sequences, out.
DEQUANTIZE_PARAMETERS = (ctypes.c_uint64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32,
                         ctypes.c_int32, ctypes.c_int32, ctypes.c_uint64, ctypes.c_int32, ctypes.c_uint64, ctypes.c_int32,
                         ctypes.c_uint64)


def dequantized_call(do, q, k, v, o, lse, softmax_scale, causal, return_dbias, features: dict) -> tuple:
    """flash_backward's FP8 call as a bfloat16 one: (q, k, v dequantised in bfloat16, the features
    without the descales). TypeError / ValueError naming the argument, before any launch, for what
    the FP8 forward refuses and for do, o, lse unlike its outputs (do and o bfloat16)."""
    features = dict(features)
    descales = {name: features.pop(name, None) for name in DESCALES}
    descales = {name: x if x is None or isinstance(x, numpy.ndarray) else _checks.as_gpu_array(name, x)
                for name, x in descales.items()}
    _checks.check_no_extra_options("flash_backward", features)
    q, k, v = (_checks.as_gpu_array(name, x) for name, x in (("q", q), ("k", k), ("v", v)))
    check_fp8_call("flash_backward", dict(q=q, k=k, v=v), descales, features)
    if _checks.check_flag("return_dbias", return_dbias):
        raise ValueError("return_dbias=True is not supported with FP8 inputs (they take no bias)")
    q, k, v, shape, _, variant = _checks.prepare_qkv(q, k, v, softmax_scale, causal, features, fp8=True)
    do, o, lse = (_checks.as_gpu_array(n, x) for n, x in (("do", do), ("o", o), ("lse", lse)))
    _checks.check_backward_extras(shape, q, do, o, lse, variant.packed, fp8=True)
    with q.device:
        _checks.same_device(q=q, k=k, v=v, do=do, o=o, lse=lse,
                            **{name: x for name, x in descales.items() if not isinstance(x, numpy.ndarray)})
        q, k, v = (_checks.kernel_ready(x) for x in (q, k, v))
        stream, capturing = current_stream()
        uploaded = upload_descales(descales, shape.heads, stream, capturing)
        packed = variant.packed
        cu_seqlens = (None, None, None) if packed is None else (packed.cu_seqlens_q, packed.cu_seqlens_k, packed.cu_seqlens_k)
        dequantised, launches = zip(*(_dequantize(x, descale_at, cu, shape.batch)
                                      for x, descale_at, cu in zip((q, k, v), uploaded.addresses, cu_seqlens)))
        record_kernel_arrays((q, k, v) + uploaded.held + dequantised)
        Packed(tuple(launch for launch, _ in launches), stream, ("rows", tuple(name for _, name in launches))).run()
        uploaded.launched(stream)
    return tuple(dequantised), features


def _dequantize(x, descale_at: int, cu_seqlens, sequences: int) -> tuple:
    """(a new bfloat16 array for x dequantised with its descales (float32 per (batch, head) of x) at
    ``descale_at``, (the launch writing it as Packed takes it, its kernel's name))."""
    import cupy

    out = cupy.empty(x.shape, dtype=bfloat16())
    if cu_seqlens is None:
        batch, row_count, heads, head_dim = x.shape
        strides, cu, sequences = x.strides[:3], 0, 0
    else:
        (row_count, heads, head_dim), batch = x.shape, 1
        strides, cu = (0, *x.strides[:2]), cu_seqlens.data.ptr
    vectors = batch * row_count * heads * (head_dim // 16)
    launch = rows.dequantize_launch("bfloat16", vectors)
    values = (x.data.ptr, *strides, batch, row_count, heads, head_dim, descale_at, heads, cu, sequences, out.data.ptr)
    arguments = tuple(kind(value) for kind, value in zip(DEQUANTIZE_PARAMETERS, values))
    return out, ((launch.kernel, launch.grid, launch.threads, 0, arguments, False), launch.name)
