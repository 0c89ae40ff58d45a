"""Row kernels of the backward (preprocess.cu): delta = rowsum(dO * O) before the main kernel, and
the dQ accumulator's scale-and-cast after it."""

from __future__ import annotations

from . import _traits
from ._compile import ModuleSpec, get_kernel

_MAX_ROW_BLOCKS = 1 << 16   # the row kernels loop over rows, so the grid never needs to be larger


def row_kernel_grid(shape) -> int:
    warps_per_block = _traits.ROW_KERNEL_THREADS // 32
    rows = shape.batch * shape.seqlen_q * shape.heads
    return min(-(-rows // warps_per_block), _MAX_ROW_BLOCKS)


def _launch(name_of, params, shape):
    spec = ModuleSpec("preprocess", shape.dtype)
    kernel = get_kernel(spec, name_of(spec))
    kernel((row_kernel_grid(shape),), (_traits.ROW_KERNEL_THREADS,), (params,))


def launch_preprocess(params, shape):
    """Fill params' delta (and lse_log2 when set) and zero its dq_accum when set."""
    _launch(ModuleSpec.preprocess_kernel, params, shape)


def launch_dq_convert(params, shape):
    """dq = softmax_scale * dq_accum, cast to dq's dtype."""
    _launch(ModuleSpec.dq_convert_kernel, params, shape)
