"""The dtypes the kernels take, by name: float16, bfloat16 (``ml_dtypes.bfloat16``), float32."""

from __future__ import annotations

import functools

import numpy

FP8_DTYPE = "float8_e4m3fn"   # the dtype named for e4m3 inputs held as uint8 bits (docs/fp8.md)


@functools.lru_cache(maxsize=None)
def bfloat16() -> numpy.dtype:
    import ml_dtypes

    return numpy.dtype(ml_dtypes.bfloat16)


def dtype_name(dtype) -> str | None:
    """'float16', 'bfloat16' or 'float32' for a supported dtype, else None."""
    dtype = numpy.dtype(dtype)
    if dtype == numpy.float16:
        return "float16"
    if dtype == numpy.float32:
        return "float32"
    if dtype == bfloat16():
        return "bfloat16"
    return None


def as_float(x, xp, dtype):
    """x as ``dtype`` (float32 or float64), reading bfloat16 by its bits so no array library needs
    bfloat16 arithmetic (CuPy has none)."""
    if dtype_name(x.dtype) == "bfloat16":
        x = (xp.ascontiguousarray(x).view(xp.uint16).astype(xp.uint32) << 16).view(xp.float32)
    return x.astype(dtype)
