"""Backward preprocessing launch: delta = rowsum(dO * O), optionally zeroing the dQ accumulator."""

from __future__ import annotations

from . import _traits
from ._compile import ModuleSpec, get_kernel
from ._params import make_params

_MAX_ROW_BLOCKS = 1 << 16   # the row kernels loop over rows, so the grid never needs to be larger


def row_kernel_grid(shape) -> int:
    warps_per_block = _traits.ROW_KERNEL_THREADS // 32
    rows = shape.batch * shape.seqlen_q * shape.heads
    return min(-(-rows // warps_per_block), _MAX_ROW_BLOCKS)


def launch_preprocess(do, o, shape, dq_accum=None):
    """delta (float32, (batch, heads, seqlen_q)) for checked, kernel-ready do and o."""
    import cupy

    delta = cupy.empty((shape.batch, shape.heads, shape.seqlen_q), dtype=cupy.float32)
    spec = ModuleSpec("preprocess", shape.dtype)
    kernel = get_kernel(spec, spec.preprocess_kernel())
    params = make_params(shape, 1.0, o=o, dout=do, delta=delta, dq_accum=dq_accum)
    kernel((row_kernel_grid(shape),), (_traits.ROW_KERNEL_THREADS,), (params,))
    return delta
