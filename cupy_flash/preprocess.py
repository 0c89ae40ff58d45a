"""Row kernels of the backward (preprocess.cu): delta = rowsum(dO * O) before the main kernel, the
dQ accumulator's scale-and-cast after it, and the GQA sum of per-query-head dK/dV."""

from __future__ import annotations

from . import _traits
from ._compile import ModuleSpec, get_kernel
from ._params import as_argument

_MAX_ROW_BLOCKS = 1 << 16   # the row kernels loop over rows, so the grid never needs to be larger


def row_kernel_grid(rows: int) -> int:
    warps_per_block = _traits.ROW_KERNEL_THREADS // 32
    return min(-(-rows // warps_per_block), _MAX_ROW_BLOCKS)


def row_kernel(name_of, shape, rows=None) -> tuple:
    """(kernel, grid, threads) of a row kernel (``name_of``: a ModuleSpec method naming it) over
    ``rows`` rows (default: every query row of ``shape``)."""
    spec = ModuleSpec("preprocess", shape.dtype)
    rows = shape.batch * shape.seqlen_q * shape.heads if rows is None else rows
    return get_kernel(spec, name_of(spec)), row_kernel_grid(rows), _traits.ROW_KERNEL_THREADS


def launch_preprocess(params, shape):
    """Fill params' delta (and lse_log2 when set) and zero its dq_accum when set (bench/preprocess_rate.py;
    the backward launches it through its plan)."""
    kernel, grid, threads = row_kernel(ModuleSpec.preprocess_kernel, shape)
    kernel((grid,), (threads,), (as_argument(params),))
