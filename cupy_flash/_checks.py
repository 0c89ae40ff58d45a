"""Argument checks, all raised before any launch.

The shape/dtype/option checks read only ``.ndim``, ``.shape`` and ``.dtype``, so they run (and are
tested) on CPU with NumPy arrays standing in for GPU arrays. ``as_gpu_array`` is the one step that
needs CuPy: it accepts CuPy arrays, and arrays of other frameworks through
``__cuda_array_interface__`` or DLPack without a copy, and rejects host memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import numbers
import sys

import numpy

from . import _traits
from ._dtypes import FP8_DTYPE, bfloat16, dtype_name
from ._features import Packed, check_variant

MAX_SEQLEN = 2**30       # keeps every in-kernel row index (and row + tile) inside int32
MAX_GRID_BLOCKS = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int               # query heads
    head_dim: int            # q's and k's
    dtype: str
    heads_kv: int = 0        # K/V heads (GQA/MQA: a divisor of heads); 0 means heads
    head_dim_v: int = 0      # v's and o's; 0 means head_dim

    def __post_init__(self):
        if self.heads_kv == 0:
            object.__setattr__(self, "heads_kv", self.heads)
        if self.head_dim_v == 0:
            object.__setattr__(self, "head_dim_v", self.head_dim)

    @property
    def group(self) -> int:
        return self.heads // self.heads_kv

    @property
    def own_head_dim_v(self) -> bool:
        """Whether v's head_dim differs from q's and k's (the variant's FEATURE_HEAD_DIM_V)."""
        return self.head_dim_v != self.head_dim

    @property
    def widest_head_dim(self) -> int:
        """The larger of head_dim and head_dim_v: what a kernel's head-dim tile must hold."""
        return max(self.head_dim, self.head_dim_v)

    @property
    def tile(self) -> int:
        """The head-dim tile of the kernels' instantiation: the larger head dim's (the kernels read
        zeros past each tensor's own head dim)."""
        return _traits.head_dim_tile(self.widest_head_dim)


def _require_rank4(name: str, x) -> None:
    if getattr(x, "ndim", None) != 4:
        raise ValueError(f"{name} must have 4 dimensions (batch, seqlen, heads, head_dim), "
                         f"got shape {tuple(getattr(x, 'shape', ()))}")


def check_qkv(q, k, v, fp8: bool = False, any_head_dim: bool = False) -> AttentionShape:
    """The shape of dense q, k, v; ``fp8``: uint8 arrays of e4m3 bits, whose rows the kernels read
    in 16-byte units (head_dim a multiple of 16). ``any_head_dim``: head dims need not be multiples
    of 8 (a caller that pads them: _padding)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _require_rank4(name, x)
    kind = FP8_DTYPE if fp8 and q.dtype == numpy.uint8 else dtype_name(q.dtype)
    if kind is None:
        raise TypeError(f"q has dtype {q.dtype}; expected float16, bfloat16 or float32")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {x.dtype} but q has dtype {q.dtype}")
    batch, seqlen_q, heads, head_dim = (int(n) for n in q.shape)
    head_dim_v = int(v.shape[3])
    multiple = 16 if kind == FP8_DTYPE else 1 if any_head_dim else 8
    for name, d in (("q", head_dim), ("v", head_dim_v)):
        if d % multiple or not multiple <= d <= _traits.MAX_HEAD_DIM:
            # Out of range, a 16-bit or float32 call hears the range every public call takes (they
            # pad other head dims: _padding); FP8 calls, and internal calls, their multiple too.
            in_range = 1 <= d <= _traits.MAX_HEAD_DIM
            expected = f"a multiple of {multiple} from {multiple} to" if multiple == 16 or in_range else "1 to"
            raise ValueError(f"{name} has head_dim {d}; expected {expected} {_traits.MAX_HEAD_DIM}"
                             + (" (FP8 rows are read in 16-byte units)" if multiple == 16 else ""))
    labels = ("batch", "seqlen", "heads", "head_dim")
    for axis in (0, 3):
        if k.shape[axis] != q.shape[axis]:
            raise ValueError(f"k has {labels[axis]} {k.shape[axis]} but q has {labels[axis]} {q.shape[axis]}")
    if tuple(v.shape[:3]) != tuple(k.shape[:3]):
        raise ValueError(f"v has shape {tuple(v.shape)} but k has shape {tuple(k.shape)}; they must match but in "
                         "the head_dim (v's may differ: o takes it)")
    if kind == FP8_DTYPE and head_dim_v != head_dim:
        raise ValueError(f"v has head_dim {head_dim_v} but q and k have {head_dim}; FP8 calls take one head_dim")
    heads_kv = int(k.shape[2])
    if heads_kv < 1 or heads % heads_kv:
        raise ValueError(f"k has {heads_kv} heads but q has {heads}; the query heads must be a multiple "
                         "of the K/V heads (MQA/GQA: each K/V head serves heads_q / heads_kv query heads)")
    seqlen_k = int(k.shape[1])
    for label, n in (("batch", batch), ("heads", heads), ("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)):
        if n < 1:
            raise ValueError(f"{label} is {n}; every dimension must be at least 1")
    for label, n in (("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)):
        if n >= MAX_SEQLEN:
            raise ValueError(f"{label} is {n}; at most {MAX_SEQLEN - 1} is supported")
    shape = AttentionShape(batch, seqlen_q, seqlen_k, heads, head_dim, kind, heads_kv, head_dim_v)
    _check_grid(shape)
    return shape


def _check_grid(shape: AttentionShape) -> None:
    # The kernels use a 1-D grid of (row blocks x batch x heads) blocks; gridDim.x < 2^31.
    smallest_block = min(min(_traits.FORWARD_BLOCKS[shape.tile]), min(_traits.BACKWARD_BLOCKS[shape.tile]))
    longest = max(shape.seqlen_q, shape.seqlen_k)
    blocks = -(-longest // smallest_block) * shape.batch * shape.heads
    if blocks > MAX_GRID_BLOCKS:
        raise ValueError(f"batch * heads * seqlen blocks is {blocks}, over CUDA's grid limit of {MAX_GRID_BLOCKS}")


def check_softmax_scale(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, (bool, numpy.bool_)) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a real number or None, got {type(softmax_scale).__name__}")
    value = float(softmax_scale)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"softmax_scale must be a finite positive number, got {value}")
    return value


def check_flag(name: str, value) -> bool:
    if not isinstance(value, (bool, numpy.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


def check_backward_extras(shape: AttentionShape, q, do, o, lse, packed=None, fp8: bool = False) -> None:
    """do and o of o's shape (q's, with v's head_dim) and q's dtype (``fp8``: bfloat16, the FP8
    forward's o), lse of the forward's shape, float32."""
    o_shape = tuple(q.shape[:-1]) + (shape.head_dim_v,)
    for name, x in (("do", do), ("o", o)):
        if getattr(x, "ndim", None) != q.ndim or tuple(x.shape) != o_shape:
            raise ValueError(f"{name} has shape {tuple(getattr(x, 'shape', ()))}; expected o's {o_shape} (q's, "
                             "with v's head_dim)")
        if fp8 and x.dtype != bfloat16():
            raise TypeError(f"{name} has dtype {x.dtype}; FP8 calls take it in bfloat16 (the FP8 forward's o)")
        if not fp8 and x.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {x.dtype} but q has dtype {q.dtype}")
    if packed is None:
        expected, labels = (shape.batch, shape.heads, shape.seqlen_q), "(batch, heads, seqlen_q)"
    else:
        expected, labels = (shape.heads, packed.total_q), "(heads, total_q)"
    if getattr(lse, "ndim", None) != len(expected) or tuple(lse.shape) != expected:
        raise ValueError(f"lse has shape {tuple(getattr(lse, 'shape', ()))}; expected {labels} = {expected}")
    if lse.dtype != numpy.float32:
        raise TypeError(f"lse has dtype {lse.dtype}; expected float32 (as returned by flash_forward)")


@functools.lru_cache(maxsize=None)
def cupy_ndarray():
    """cupy.ndarray, looked up once (the plan caches' keys ask for it on every call)."""
    import cupy

    return cupy.ndarray


def qkv_key(q, k, v, softmax_scale, causal, kernels_setting: str) -> tuple | None:
    """What a forward's checks and plan read of q, k, v and its options (for the plan caches'
    keys), or None where one is not a CuPy array."""
    ndarray = cupy_ndarray()
    if type(q) is not ndarray or type(k) is not ndarray or type(v) is not ndarray:
        return None
    q_data, k_data, v_data = q.data, k.data, v.data
    # The addresses' alignment as one value: a kept plan's arrays were read in place, 16-byte aligned
    # (readable_in_place), so only a key whose three are aligned can find one.
    return (q.shape, q.strides, k.shape, k.strides, v.shape, v.strides, q.dtype, k.dtype, v.dtype,
            (q_data.ptr | k_data.ptr | v_data.ptr) & 15, q_data.device_id, k_data.device_id, v_data.device_id,
            type(softmax_scale), softmax_scale, type(causal), causal, kernels_setting)


def backward_extras_key(ndarray: type, do, o, lse, deterministic) -> tuple | None:
    """What the backward's checks and plan read of do, o, lse and deterministic (for the plan
    caches' keys), or None where one is not an ``ndarray`` (a CuPy array)."""
    if type(do) is not ndarray or type(o) is not ndarray or type(lse) is not ndarray:
        return None
    do_data, o_data, lse_data = do.data, o.data, lse.data
    return (do.shape, do.strides, do.dtype, do_data.ptr % 16, do_data.device_id,
            o.shape, o.strides, o.dtype, o_data.ptr % 16, o_data.device_id,
            lse.shape, lse.strides, lse.dtype, lse_data.device_id, type(deterministic), deterministic)


PACKED_KEYWORDS = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "block_table")
FEATURE_KEYWORDS = ("window_size", "softcap", "alibi_slopes", "sink", "bias") + PACKED_KEYWORDS


# The keywords the public functions name besides the variants: a misspelling of one is answered.
NAMED_KEYWORDS = ("softmax_scale", "causal", "num_splits", "stream", "deterministic", "return_dbias", "out",
                  "k_new", "v_new", "cache_seqlens", "block_table")


def did_you_mean(names, choices) -> str:
    """`` (did you mean causal for casual?)`` for names close to one of ``choices``, else ''."""
    import difflib

    close = [f"{match[0]} for {name}" for name in names
             if (match := difflib.get_close_matches(name, choices, n=1, cutoff=0.7))]
    return f" (did you mean {', '.join(close)}?)" if close else ""


def check_no_extra_options(function: str, options: dict, paged: bool = True) -> None:
    """TypeError for a keyword that is not a feature's; ``paged``: whether ``function`` takes
    block_table (the backward does not: ValueError)."""
    unknown = sorted(set(options) - set(FEATURE_KEYWORDS))
    if unknown:
        raise TypeError(f"{function}() got unsupported keyword argument(s): {', '.join(unknown)}"
                        + did_you_mean(unknown, FEATURE_KEYWORDS + NAMED_KEYWORDS))
    if not paged and options.get("block_table") is not None:
        raise ValueError(f"block_table is not supported by {function}: the gradients need contiguous K and V "
                         "(a paged cache is read by flash_forward and flash_decode only)")


# ---------------------------------------------------------------------------------------------
# GPU arrays.

_DLPACK_CUDA_DEVICES = (2, 13)   # kDLCUDA, kDLCUDAManaged


def as_gpu_array(name: str, x):
    """A CuPy view of ``x`` (no copy), or TypeError naming the argument."""
    import cupy

    if isinstance(x, cupy.ndarray):
        return x
    if isinstance(x, numpy.ndarray):
        raise TypeError(f"{name} is a NumPy array in host memory; expected a CuPy array "
                        "(or a GPU array exposing __cuda_array_interface__ or __dlpack__)")
    if "float8_e4m3fn" in str(getattr(x, "dtype", "")):
        x = _fp8_bits(x)
    # DLPack first: it carries the dtype (bfloat16 included), where __cuda_array_interface__
    # has no code for bfloat16.
    if hasattr(type(x), "__dlpack__"):
        device = x.__dlpack_device__()[0] if hasattr(type(x), "__dlpack_device__") else None
        if device is not None and int(device) not in _DLPACK_CUDA_DEVICES:
            raise TypeError(f"{name} lives on DLPack device type {int(device)}; expected a CUDA GPU array")
        array = cupy.from_dlpack(x)
    elif hasattr(type(x), "__cuda_array_interface__"):
        array = cupy.asarray(x)
    else:
        raise TypeError(f"{name} must be a CuPy array (or a GPU array exposing __cuda_array_interface__ "
                        f"or __dlpack__), got {type(x).__name__}")
    # CuPy 14 imports a DLPack bfloat16 tensor as 2-byte void ('|V2'); the source names the dtype.
    if array.dtype.kind == "V" and array.dtype.itemsize == 2 and "bfloat16" in str(getattr(x, "dtype", "")):
        array = array.view(bfloat16())
    return array


def fp8_as_bits(x):
    """x, or where it is a PyTorch or JAX float8_e4m3fn array, its uint8 bits (_fp8_bits)."""
    return _fp8_bits(x) if "float8_e4m3fn" in str(getattr(x, "dtype", "")) else x


def _fp8_bits(x):
    """A PyTorch or JAX e4m3 array as uint8 bits, the form the FP8 calls take (CuPy holds no FP8
    dtype and refuses it through DLPack): a view in PyTorch, a bitcast in JAX. Their modules are
    loaded already where such an array exists."""
    package = type(x).__module__.split(".")[0]
    if package == "torch":
        return x.view(sys.modules["torch"].uint8)
    if package in ("jax", "jaxlib"):
        jax = sys.modules["jax"]
        return jax.lax.bitcast_convert_type(x, jax.numpy.uint8)
    return x


class _ShapeOf:
    """A stand-in with a leading batch axis of 1, so packed (total, heads, d) arrays go through
    check_qkv's dtype and head checks."""

    def __init__(self, x):
        self.shape, self.dtype, self.ndim = (1,) + tuple(x.shape), x.dtype, x.ndim + 1


# Prefix sums whose host copy the caller holds, by the device array's id (the array held beside
# its copy, so the id stays its own): the ring's, made once from host offsets and never written,
# whose packed calls then read nothing back (known_prefix_sums).
_known_prefix_sums: dict = {}


@contextlib.contextmanager
def known_prefix_sums(device_array, host):
    """Inside, a packed call given ``device_array`` (int32 prefix sums on the GPU) checks ``host``, its
    copy, instead of reading it back (a device-to-host copy: a sync). For a caller that made the
    array from ``host`` and writes it no more."""
    key = id(device_array)
    _known_prefix_sums[key] = (device_array, numpy.asarray(host, dtype=numpy.int64))
    try:
        yield
    finally:
        _known_prefix_sums.pop(key, None)


def _known_host(cu):
    """The host copy known_prefix_sums holds for the device array ``cu`` itself, or None."""
    known = _known_prefix_sums.get(id(cu))
    return known[1] if known is not None and known[0] is cu else None


_KNOWN_OFFSETS_KEYWORDS = frozenset(("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"))


def known_offsets_key(features: dict) -> tuple | None:
    """For the plan caches' keys: what a packed call's checks and plan read of its ``features``
    where they are only cu_seqlens_q / _k (both with host copies in known_prefix_sums) and
    max_seqlen_q / _k (ints or None): the arrays' ids (a kept plan holds its arrays, so no other
    array takes the id while the plan is kept), their host copies' bytes and the maxima. None
    otherwise (the checked route)."""
    if not features or not _KNOWN_OFFSETS_KEYWORDS.issuperset(features):
        return None
    parts = []
    for name in ("cu_seqlens_q", "cu_seqlens_k"):
        cu = features.get(name)
        host = _known_host(cu)
        if host is None:
            return None
        parts += (id(cu), host.tobytes())
    for name in ("max_seqlen_q", "max_seqlen_k"):
        value = features.get(name)
        if value is not None and type(value) is not int:
            return None
        parts.append(value)
    return tuple(parts)


def _check_cu_seqlens(name: str, cu, total: int | None, total_name: str):
    """The host copy of an int32 prefix-sum array (one small device-to-host copy: a sync, unless
    known_prefix_sums holds it); ``total``: where it must end (None: anywhere)."""
    if getattr(cu, "ndim", None) != 1 or cu.shape[0] < 2:
        raise ValueError(f"{name} must be a 1-D array of batch + 1 >= 2 offsets, got shape {tuple(getattr(cu, 'shape', ()))}")
    if cu.dtype != numpy.int32:
        raise TypeError(f"{name} has dtype {cu.dtype}; expected int32")
    host = _known_host(cu)
    if host is None:
        import cupy

        host = cupy.asnumpy(cu).astype(numpy.int64)
    if host[0] != 0:
        raise ValueError(f"{name} must start at 0, got {int(host[0])}")
    if (numpy.diff(host) < 0).any():
        raise ValueError(f"{name} must be non-decreasing (prefix sums of sequence lengths), got {host.tolist()[:16]}")
    if total is not None and host[-1] != total:
        raise ValueError(f"{name} ends at {int(host[-1])} but {total_name} has {total} rows; they must match")
    return host


def _check_max_seqlen(name: str, value, actual: int) -> int:
    if value is None:
        return actual
    if isinstance(value, (bool, numpy.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < actual:
        raise ValueError(f"{name} is {int(value)} but the longest sequence has {actual} rows")
    if value >= MAX_SEQLEN:
        raise ValueError(f"{name} is {int(value)}; at most {MAX_SEQLEN - 1} is supported")
    return int(value)


def check_index_array(name, x, shape, labels):
    """An int32 array of ``shape`` (None: any), or TypeError / ValueError naming it."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"{name} must be an int32 array of shape {labels}, got {type(x).__name__}")
    if x.dtype != numpy.int32:
        raise TypeError(f"{name} has dtype {x.dtype}; expected int32")
    if shape is not None and tuple(int(n) for n in x.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)}; expected {labels} = {shape}")


def check_block_table(block_table, k_cache, batch: int, name: str = "k_cache") -> tuple[int, int]:
    """(page_shift, keys a sequence holds) of a paged cache: k_cache (pages, page_size, heads_kv, d)
    with page_size a power of two >= 16, so a kernel's 16-key tile never crosses a page, and
    block_table int32 (batch, pages per sequence). Reads .shape/.dtype only."""
    check_index_array("block_table", block_table, None, "(batch, pages per sequence)")
    if block_table.ndim != 2 or int(block_table.shape[0]) != batch or int(block_table.shape[1]) < 1:
        raise ValueError(f"block_table has shape {tuple(block_table.shape)}; expected (batch, pages per "
                         f"sequence) with batch {batch}")
    page_size = int(k_cache.shape[1])
    if page_size < 16 or page_size & (page_size - 1):
        raise ValueError(f"{name} has pages of {page_size} keys (its axis 1); a paged cache needs a power "
                         "of two from 16 up")
    return page_size.bit_length() - 1, int(block_table.shape[1]) * page_size


def check_packed(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                 block_table=None, fp8: bool = False):
    """Shape and ``_features.Packed`` of a packed variable-length batch: q (total_q, heads_q, d),
    k and v (total_k, heads_kv, d), cu_seqlens int32 prefix sums on the GPU (read back once to
    check them: non-decreasing from 0 to the total). With ``block_table``, k and v are a paged
    cache (pages, page_size, heads_kv, d) as flash_decode's (check_block_table), and cu_seqlens_k's
    lengths fit each sequence's pages. ``fp8``: check_qkv's."""
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu is None:
            raise ValueError(f"{name} is missing: packed batches need both cu_seqlens_q and cu_seqlens_k"
                             + (" (block_table pages K and V of a packed batch; a dense batch's paged cache: "
                                "flash_decode)" if block_table is not None else ""))
    paged = block_table is not None
    for name, x in (("q", q), ("k", k), ("v", v)):
        rank = 4 if paged and name != "q" else 3
        if getattr(x, "ndim", None) != rank:
            layout = "(pages, page_size, heads, head_dim) with block_table" if rank == 4 else \
                "(total_tokens, heads, head_dim) with cu_seqlens"
            raise ValueError(f"{name} must have {rank} dimensions {layout}, got shape {tuple(getattr(x, 'shape', ()))}")
    if paged:
        if fp8:
            raise ValueError("block_table is not supported with FP8 inputs: their forward reads contiguous K and V")
        if dtype_name(q.dtype) not in ("float16", "bfloat16"):
            raise TypeError(f"block_table takes float16 or bfloat16 inputs; q has dtype {q.dtype}")
        k_rows, v_rows = (_Described.of((1, x.shape[0] * x.shape[1]) + tuple(x.shape[2:]), x.dtype) for x in (k, v))
        dense = check_qkv(_ShapeOf(q), k_rows, v_rows)
    else:
        dense = check_qkv(_ShapeOf(q), _ShapeOf(k), _ShapeOf(v), fp8=fp8)
    cu_q, cu_k = as_gpu_array("cu_seqlens_q", cu_seqlens_q), as_gpu_array("cu_seqlens_k", cu_seqlens_k)
    if getattr(cu_q, "shape", None) != getattr(cu_k, "shape", None):
        raise ValueError(f"cu_seqlens_q has shape {tuple(cu_q.shape)} but cu_seqlens_k has shape "
                         f"{tuple(cu_k.shape)}; both hold batch + 1 offsets")
    total_q = int(q.shape[0])
    total_k = None if paged else int(k.shape[0])
    for label, total in (("q", total_q), ("k", total_k)):
        if total is not None and total >= 2**31:
            raise ValueError(f"{label} has {total} rows; packed batches support fewer than 2^31 tokens")
    host_q = _check_cu_seqlens("cu_seqlens_q", cu_q, total_q, "q")
    host_k = _check_cu_seqlens("cu_seqlens_k", cu_k, total_k, "k")
    page_shift = 0
    if paged:
        page_shift, capacity = check_block_table(block_table, k, len(host_q) - 1, "k")
        longest = int(numpy.diff(host_k).max())
        if longest > capacity:
            raise ValueError(f"cu_seqlens_k gives a sequence {longest} keys but block_table holds "
                             f"{capacity} per sequence ({block_table.shape[1]} pages of {k.shape[1]})")
        block_table = as_gpu_array("block_table", block_table)
        total_k = int(host_k[-1])
    max_q = _check_max_seqlen("max_seqlen_q", max_seqlen_q, int(numpy.diff(host_q).max()))
    max_k = _check_max_seqlen("max_seqlen_k", max_seqlen_k, int(numpy.diff(host_k).max()))
    shape = AttentionShape(len(host_q) - 1, max(max_q, 1), max(max_k, 1), dense.heads, dense.head_dim,
                           dense.dtype, dense.heads_kv, dense.head_dim_v)
    _check_grid(shape)
    return shape, Packed(cu_q, cu_k, total_q, total_k, host_q, host_k, block_table, page_shift)


def prepare_qkv(q, k, v, softmax_scale, causal, features=None, fp8: bool = False):
    """GPU views of q, k, v and their checked shape, scale and variant (``_features.Variant``, with
    its arrays on the GPU): the checks shared by the forward and backward entry points. ``features``
    are the feature keywords (window_size, softcap, alibi_slopes, sink, bias, cu_seqlens_q/k,
    max_seqlen_q/k). For a packed batch the shape's seqlens are the longest sequence's. ``fp8``:
    check_qkv's."""
    features = dict(features or {})
    packed_options = {name: features.pop(name, None) for name in PACKED_KEYWORDS}
    q, k, v = (as_gpu_array(n, x) for n, x in (("q", q), ("k", k), ("v", v)))
    packed = None
    if any(packed_options[name] is not None for name in ("cu_seqlens_q", "cu_seqlens_k", "block_table")):
        shape, packed = check_packed(q, k, v, fp8=fp8, **packed_options)
    else:
        for name in ("max_seqlen_q", "max_seqlen_k"):
            if packed_options[name] is not None:
                raise ValueError(f"{name} is only meaningful with cu_seqlens_q and cu_seqlens_k (packed batches)")
        shape = check_qkv(q, k, v, fp8=fp8)
    scale = check_softmax_scale(softmax_scale, shape.head_dim)
    causal = check_flag("causal", causal)
    for name in ("alibi_slopes", "sink", "bias"):
        if features.get(name) is not None:
            features[name] = as_gpu_array(name, features[name])
    variant = check_variant(shape.batch, shape.heads, causal, seqlen_q=shape.seqlen_q, seqlen_k=shape.seqlen_k,
                            packed=packed, head_dim_v=shape.own_head_dim_v, **features)
    return q, k, v, shape, scale, variant


def same_device(**arrays) -> int:
    devices = {name: x.device.id for name, x in arrays.items()}
    first_name, first = next(iter(devices.items()))
    for name, device in devices.items():
        if device != first:
            raise ValueError(f"{name} is on GPU {device} but {first_name} is on GPU {first}; "
                             "all arrays must be on one device")
    return first


def _address_and_strides(x) -> tuple[int, tuple] | None:
    """An array's address and byte strides (CuPy's, NumPy's, or a __cuda_array_interface__'s), or
    None where they are unknown (JAX)."""
    if hasattr(getattr(x, "data", None), "ptr"):
        return x.data.ptr, tuple(x.strides)
    if hasattr(x, "__array_interface__"):
        return x.__array_interface__["data"][0], tuple(x.strides)
    interface = getattr(x, "__cuda_array_interface__", None)
    if interface is None:
        return None
    strides = interface.get("strides")
    if strides is None:   # C-contiguous
        strides, step = [], x.dtype.itemsize
        for n in reversed(tuple(x.shape)):
            strides.insert(0, step)
            step *= int(n)
    return interface["data"][0], tuple(strides)


def may_share_memory(a, b) -> bool:
    """Whether two arrays may have elements in common: their spans of bytes overlap, except that two
    views of one nested layout (the same outer strides, a last axis of unit stride) whose rows start
    closer than the smallest outer stride share memory only where their rows' bytes meet (a fused
    buffer's k = kv[..., :d] and v = kv[..., d:] do not; MLA's v = k[..., :512] does). False where
    an address is unknown or an array is empty."""
    found = [_address_and_strides(x) for x in (a, b)]
    if any(f is None for f in found) or any(int(n) == 0 for x in (a, b) for n in x.shape):
        return False
    (address_a, strides_a), (address_b, strides_b) = found
    spans = []
    for x, address, strides in ((a, address_a, strides_a), (b, address_b, strides_b)):
        shape = tuple(int(n) for n in x.shape)
        spans.append((address + sum(min(0, (n - 1) * s) for n, s in zip(shape, strides)),
                      address + sum(max(0, (n - 1) * s) for n, s in zip(shape, strides)) + x.dtype.itemsize))
    if not (spans[0][0] < spans[1][1] and spans[1][0] < spans[0][1]):
        return False
    if (a.ndim == b.ndim and a.ndim > 1 and strides_a[:-1] == strides_b[:-1] and tuple(a.shape[:-1]) == tuple(b.shape[:-1])
            and strides_a[-1] == a.dtype.itemsize and strides_b[-1] == b.dtype.itemsize):
        # Outer axes nested (each stride past the span of the smaller ones), so rows at different
        # outer indices lie at least the smallest stride apart, and the two rows together fit in it.
        outer = sorted((s, int(n)) for s, n in zip(strides_a[:-1], a.shape[:-1]) if int(n) > 1)
        offset = address_b - address_a
        row_a, row_b = int(a.shape[-1]) * a.dtype.itemsize, int(b.shape[-1]) * b.dtype.itemsize
        nested = all(later[0] >= s * n for (s, n), later in zip(outer, outer[1:]))
        if not outer or (nested and outer[0][0] > 0 and max(row_a, offset + row_b) - min(0, offset) <= outer[0][0]):
            return offset < row_a and -offset < row_b
    return True


def readable_in_place(x) -> bool:
    """Whether the kernels can read (or write) ``x`` as it is: last axis contiguous and every row
    starting on a 16-byte boundary, since the kernels move 16-byte vectors."""
    itemsize = x.dtype.itemsize
    return (x.data.ptr % 16 == 0
            and x.strides[-1] == itemsize
            and all(s % 16 == 0 for s in x.strides[:-1]))


def kernel_ready(x):
    """``x`` itself when ``readable_in_place``; otherwise a fresh C-contiguous copy, made once per
    call (``ascontiguousarray`` alone would keep a misaligned contiguous view). The input is never
    modified."""
    return x if readable_in_place(x) else x.copy(order="C")


def output_buffer(name: str, x, shape: tuple, dtype, device_id: int):
    """A CuPy view of ``x``, an output buffer a caller hands in (the adapters' framework-allocated
    outputs), or ValueError naming it unless it is C-contiguous, 16-byte aligned (the kernels'
    vector stores and the Hopper kernels' tensor maps; a misaligned store is a sticky CUDA error),
    of ``shape`` and ``dtype``, on device ``device_id``."""
    import cupy

    view = as_gpu_array(name, x)
    shape, dtype = tuple(shape), cupy.dtype(dtype)
    if (tuple(view.shape) != shape or view.dtype != dtype or not view.flags.c_contiguous or view.data.device_id != device_id
            or view.data.ptr % 16):
        raise ValueError(f"{name} (an output buffer) is {view.dtype} {tuple(view.shape)} on device {view.data.device_id}, "
                         f"contiguous={view.flags.c_contiguous}, address % 16 = {view.data.ptr % 16}; expected C-contiguous "
                         f"{dtype} {shape} on device {device_id}, 16-byte aligned")
    return view


TRACED_OPTIONS = ("softmax_scale", "causal", "window_size", "softcap", "deterministic")


def check_traced_call(caller: str, q, k, v, options: dict) -> tuple:
    """flash_forward's checks on arrays known by shape and dtype alone (a JAX tracer: the JAX adapter
    checks while tracing, before anything runs), raising the errors an eager call would; returns the
    options as a hashable tuple of (name, value). Only TRACED_OPTIONS are taken."""
    unknown = sorted(set(options) - set(TRACED_OPTIONS))
    if unknown:
        raise TypeError(f"{caller} got unsupported option(s) {unknown}; it takes {list(TRACED_OPTIONS)} "
                        "(alibi_slopes, sink, bias and packed batches: call cupy_flash on CuPy arrays)"
                        + did_you_mean(unknown, TRACED_OPTIONS))
    described = []
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array with shape and dtype, got {type(x).__name__}")
        described.append(_Described(x))
    shape = check_qkv(*described, any_head_dim=True)   # the calls pad head dims off 16-byte rows (_padding)
    scale = check_softmax_scale(options.get("softmax_scale"), shape.head_dim)
    causal = check_flag("causal", options.get("causal", False))
    deterministic = check_flag("deterministic", options.get("deterministic", False))
    window_size, softcap = options.get("window_size"), options.get("softcap", 0.0)
    check_variant(shape.batch, shape.heads, causal, seqlen_q=shape.seqlen_q, seqlen_k=shape.seqlen_k,
                  window_size=window_size, softcap=softcap)
    window = None if window_size is None else tuple(int(n) for n in window_size)
    return (("softmax_scale", float(scale)), ("causal", causal), ("window_size", window),
            ("softcap", float(softcap)), ("deterministic", deterministic))


class _Described:
    """An array's shape and dtype, as check_qkv reads them."""

    def __init__(self, x):
        self.shape, self.ndim, self.dtype = tuple(int(n) for n in x.shape), len(x.shape), numpy.dtype(x.dtype)

    @classmethod
    def of(cls, shape: tuple, dtype):
        """The description of an array of ``shape`` and ``dtype``."""
        described = cls.__new__(cls)
        described.shape, described.ndim, described.dtype = tuple(int(n) for n in shape), len(shape), numpy.dtype(dtype)
        return described
