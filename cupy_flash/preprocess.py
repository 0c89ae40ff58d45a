"""Row kernels of the backward (preprocess.cu): delta = rowsum(dO * O) before the main kernel, the
dQ accumulator's scale-and-cast after it, and the GQA sum of per-query-head dK/dV."""

from __future__ import annotations

from . import _families, _traits
from ._compile import ModuleSpec, get_kernel
from ._params import as_argument

_MAX_ROW_BLOCKS = 1 << 16   # the row kernels loop over rows, so the grid never needs to be larger


def row_kernel_grid(rows: int) -> int:
    warps_per_block = _traits.ROW_KERNEL_THREADS // 32
    return min(-(-rows // warps_per_block), _MAX_ROW_BLOCKS)


# Blocks of a backward row kernel per multiprocessor (256 threads each; the warps loop over the
# rows). A grid of a warp per row (capped at 2^16 blocks) left most warps without a row once a warp
# took several (preprocess.cu's row groups: 2-8 rows a pass at d = 256-64), so most blocks started
# only to exit. Measured (H100, bf16, 16k tokens x 2048 features, per launch, queued): preprocess /
# convert d = 64 150 / 105 -> 107 / 72 us, d = 128 123 / 85 -> 103 / 72, d = 256 107 / 74 -> 101 / 73;
# 4, 8, 16 and 64 blocks an SM: 113 / 75, 115 / 78, 106 / 73, 107 / 71 at d = 64.
_ROW_BLOCKS_PER_SM = 32


def row_kernel(name_of, shape, rows=None) -> tuple:
    """(kernel, grid, threads) of a row kernel (``name_of``: a ModuleSpec method naming it) over
    ``rows`` rows (default: every query row of ``shape``)."""
    spec = ModuleSpec("preprocess", shape.dtype)
    rows = shape.batch * shape.seqlen_q * shape.heads if rows is None else rows
    grid = min(row_kernel_grid(rows), _ROW_BLOCKS_PER_SM * _families.current_device().multiprocessors)
    return get_kernel(spec, name_of(spec)), grid, _traits.ROW_KERNEL_THREADS


def launch_preprocess(params, shape):
    """Fill params' delta (and lse_log2 when set) and zero its dq_accum when set (bench/preprocess_rate.py;
    the backward launches it through its plan)."""
    kernel, grid, threads = row_kernel(ModuleSpec.preprocess_kernel, shape)
    kernel((grid,), (threads,), (as_argument(params),))
