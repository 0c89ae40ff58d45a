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


def _launch(name_of, params, shape, rows=None):
    spec = ModuleSpec("preprocess", shape.dtype)
    kernel = get_kernel(spec, name_of(spec))
    rows = shape.batch * shape.seqlen_q * shape.heads if rows is None else rows
    kernel((row_kernel_grid(rows),), (_traits.ROW_KERNEL_THREADS,), (as_argument(params),))


def launch_preprocess(params, shape):
    """Fill params' delta (and lse_log2 when set) and zero its dq_accum when set."""
    _launch(ModuleSpec.preprocess_kernel, params, shape)


def launch_dq_convert(params, shape):
    """dq = softmax_scale * dq_accum, cast to dq's dtype."""
    _launch(ModuleSpec.dq_convert_kernel, params, shape)


def launch_kv_group_sum(params, shape):
    """dk, dv = the per-query-head dk_expanded, dv_expanded summed over each K/V head's group."""
    _launch(ModuleSpec.kv_group_sum_kernel, params, shape, rows=shape.batch * shape.seqlen_k * shape.heads_kv)
