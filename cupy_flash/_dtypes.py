"""The dtypes the kernels take, by name: float16, bfloat16 (``ml_dtypes.bfloat16``), float32."""

from __future__ import annotations

import functools

import numpy


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
