"""The row kernels (kernels_cu/preprocess.cu, every dtype, any GPU): a warp per row, looping over
the rows. The backward's preprocess (delta = rowsum(dO * O), lse in log2, the dQ accumulator
zeroed), the scale-and-cast of the dQ accumulator, the GQA sum of per-query-head dK/dV, the
FP8 backward's dequantisation of q, k, v (a thread per 16 elements), and the ring's merge of partial
outputs and its float32 accumulations (distributed.py)."""

from __future__ import annotations

from .. import _traits
from .._compile import ModuleSpec, get_kernel
from .._launch import Launch
from .._params import as_argument
from ._base import current_device, spec_with, template

_MAX_ROW_BLOCKS = 1 << 16   # the row kernels loop over rows, so the grid never needs to be larger

# Blocks of a backward row kernel per multiprocessor (256 threads each; the warps loop over the
# rows). A grid of a warp per row (capped at 2^16 blocks) left most warps without a row once a warp
# took several (preprocess.cu's row groups: 2-8 rows a pass at d = 256-64), so most blocks started
# only to exit. Measured (H100, bf16, 16k tokens x 2048 features, per launch, queued): preprocess /
# convert d = 64 150 / 105 -> 107 / 72 us, d = 128 123 / 85 -> 103 / 72, d = 256 107 / 74 -> 101 / 73;
# 4, 8, 16 and 64 blocks an SM: 113 / 75, 115 / 78, 106 / 73, 107 / 71 at d = 64.
_ROW_BLOCKS_PER_SM = 32

PREPROCESS, DQ_CONVERT, KV_GROUP_SUM = "flash_preprocess_kernel", "flash_dq_convert_kernel", "flash_kv_group_sum_kernel"
FP8_DEQUANTIZE, FP8_GROUP_AMAX, FP8_QUANTIZE = "fp8_dequantize_kernel", "fp8_group_amax_kernel", "fp8_quantize_kernel"
RING_MERGE, RING_ACCUMULATE = "ring_merge_kernel", "ring_accumulate_kernel"


def module_spec(dtype: str) -> ModuleSpec:
    spec = ModuleSpec("preprocess", dtype)
    return spec_with(spec, (template(kernel, spec.ctype) for kernel in (PREPROCESS, DQ_CONVERT, KV_GROUP_SUM, FP8_DEQUANTIZE,
                                                                      FP8_GROUP_AMAX, FP8_QUANTIZE, RING_MERGE,
                                                                      RING_ACCUMULATE)))


def row_kernel_grid(rows: int) -> int:
    warps_per_block = _traits.ROW_KERNEL_THREADS // 32
    return min(-(-rows // warps_per_block), _MAX_ROW_BLOCKS)


def _capped_row_grid(rows: int) -> int:
    """A row kernel's grid over ``rows`` rows: a warp per row, at most _ROW_BLOCKS_PER_SM blocks an SM."""
    return min(row_kernel_grid(rows), _ROW_BLOCKS_PER_SM * current_device().multiprocessors)


def row_launch(kernel: str, shape, rows: int | None = None, record: str = "main") -> Launch:
    """The Launch of row kernel ``kernel`` (PREPROCESS, DQ_CONVERT, KV_GROUP_SUM) over ``rows`` rows
    (default: every query row of ``shape``), taking params record ``record``."""
    spec = module_spec(shape.dtype)
    rows = shape.batch * shape.seqlen_q * shape.heads if rows is None else rows
    grid = _capped_row_grid(rows)
    name = template(kernel, spec.ctype)
    return Launch(name, get_kernel(spec, name), grid, _traits.ROW_KERNEL_THREADS, record=record)


def _vector_grid(vectors: int) -> int:
    """Blocks of the FP8 vector kernels (a thread per 16 elements, looping past the grid's cap)."""
    return max(min(-(-vectors // _traits.ROW_KERNEL_THREADS), _ROW_BLOCKS_PER_SM * current_device().multiprocessors), 1)


def dequantize_launch(dtype: str, vectors: int) -> Launch:
    """The Launch of fp8_dequantize_kernel writing ``dtype`` over ``vectors`` 16-element vectors."""
    spec = module_spec(dtype)
    name = template(FP8_DEQUANTIZE, spec.ctype)
    return Launch(name, get_kernel(spec, name), _vector_grid(vectors), _traits.ROW_KERNEL_THREADS)


def max_quantize_rows() -> int:
    """The longest sequence quantize_e4m3 takes: fp8_group_amax_kernel's row blocks are its grid's y."""
    return _traits.FP8_AMAX_ROWS * 65535


def quantize_e4m3(x, out=None):
    """quantize_fp8's GPU path (fp8_group_amax_kernel, then fp8_quantize_kernel, on the current
    stream): x kernel-ready, (batch, seqlen, heads, head_dim) float16 / bfloat16 / float32 with
    head_dim a multiple of 16 and seqlen at most max_quantize_rows(); returns (e4m3 bits, C-contiguous
    like x; descale float32 (batch, heads)), quantize_fp8's bits, written into ``out`` = (bits,
    descale), C-contiguous CuPy arrays of those shapes, where given."""
    import cupy
    import numpy

    from .._dtypes import dtype_name

    batch, seqlen, heads, head_dim = (int(n) for n in x.shape)
    spec = module_spec(dtype_name(x.dtype))
    strides = tuple(numpy.int64(s // x.dtype.itemsize) for s in x.strides[:3])
    amax = cupy.zeros((batch, heads), dtype=cupy.uint32)
    bits, descale = out if out is not None else (cupy.empty(x.shape, dtype=cupy.uint8),
                                                 cupy.empty((batch, heads), dtype=cupy.float32))
    group_amax = get_kernel(spec, template(FP8_GROUP_AMAX, spec.ctype))
    group_amax((batch * heads, -(-seqlen // _traits.FP8_AMAX_ROWS)), (_traits.ROW_KERNEL_THREADS,),
               (x, *strides, numpy.int32(seqlen), numpy.int32(heads), numpy.int32(head_dim), amax))
    quantize = get_kernel(spec, template(FP8_QUANTIZE, spec.ctype))
    quantize((_vector_grid(batch * seqlen * heads * (head_dim // 16)),), (_traits.ROW_KERNEL_THREADS,),
             (x, *strides, numpy.int32(batch), numpy.int32(seqlen), numpy.int32(heads), numpy.int32(head_dim), amax, bits,
              descale))
    return bits, descale


def _rows_grid(rows: int) -> tuple[int]:
    return (max(_capped_row_grid(rows), 1),)


def ring_merge(o_acc, lse_acc, o, lse, row0: int) -> None:
    """ring_merge_kernel on the current stream: rows [row0, row0 + n) of the float32 running (o_acc
    (batch, local, heads, head_dim_v), lse_acc (batch, heads, local)) joined with a block's (o (batch,
    n, heads, head_dim_v), lse (batch, heads, n) float32), every array C-contiguous."""
    import numpy

    from .._dtypes import dtype_name

    batch, local, heads, head_dim_v = (int(n) for n in o_acc.shape)
    n = int(o.shape[1])
    spec = module_spec(dtype_name(o.dtype))
    kernel = get_kernel(spec, template(RING_MERGE, spec.ctype))
    kernel(_rows_grid(batch * n * heads), (_traits.ROW_KERNEL_THREADS,),
           (o_acc, lse_acc, o, lse, *(numpy.int32(v) for v in (batch, local, row0, n, heads, head_dim_v))))


def ring_accumulate(acc, x, row0: int) -> None:
    """ring_accumulate_kernel on the current stream: acc[:, row0:row0 + n] += x, acc float32 (batch,
    rows, ...) and x (batch, n, ...) of one trailing shape, both C-contiguous."""
    import numpy

    from .._dtypes import dtype_name

    batch, acc_rows, n = int(acc.shape[0]), int(acc.shape[1]), int(x.shape[1])
    inner = int(x.size) // max(batch * n, 1)
    spec = module_spec(dtype_name(x.dtype))
    kernel = get_kernel(spec, template(RING_ACCUMULATE, spec.ctype))
    kernel(_rows_grid(batch * n), (_traits.ROW_KERNEL_THREADS,),
           (acc, x, *(numpy.int32(v) for v in (batch, acc_rows, row0, n, inner))))


def launch_preprocess(params, shape):
    """Fill params' delta (and lse_log2 when set) and zero its dq_accum when set (bench/preprocess_rate.py;
    the backward launches it through its plan)."""
    launch = row_launch(PREPROCESS, shape)
    launch.kernel((launch.grid,), (launch.threads,), (as_argument(params),))


def module_specs(dtype: str, features) -> list:
    return [module_spec(dtype)]
