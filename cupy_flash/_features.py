"""Attention variants: the feature keywords, checked before any launch, and the kernel flags they select.

Every variant is a compile-time flag of the kernels (``FEATURE_*`` in kernels_cu/common.cuh), so a
plain call runs the plain instantiation. Masks are bands around the bottom-right diagonal: with
shift = seqlen_k - seqlen_q, key j is visible from query i iff

    j - i <= shift + window_right      (causal: window_right = 0; a window's right size; else none)
    j - i >= shift - window_left       (a window's left size; else none)

The shape/dtype checks read only ``.shape``, ``.ndim`` and ``.dtype``, so they run on CPU.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import numpy

from ._dtypes import dtype_name

FEATURE_WINDOW = 1
FEATURE_SOFTCAP = 2
FEATURE_ALIBI = 4
FEATURE_SINK = 8
FEATURE_BIAS = 16
FEATURE_VARLEN = 32
# v's head_dim (o's) differs from q's and k's: the kernels read head_dim_v for v, o, dO and dV. A
# flag, so calls with one head_dim run the instantiations they ran before (no register held for a
# second bound: the mma.sync forward spilled 36 bytes with one at d = 128).
FEATURE_HEAD_DIM_V = 64
# flash_decode's cache_batch_idx / cache_leftpad (FlashAttention-2's flash_attn_with_kvcache): each
# sequence's cache row from an index array, its keys from a first row. A flag, so plain decoding
# runs the instantiations it ran before.
FEATURE_CACHE_INDEX = 128
# flash_forward's packed batches with block_table: K and V read from a paged cache (flash_decode's
# layout), the tensor-core forward only. A flag, so contiguous calls run the instantiations they ran
# before.
FEATURE_PAGED = 256
# flash_decode with an FP8 cache: e4m3 keys and values read as bytes and converted in the kernel, a
# descale per (sequence, K/V head). A flag, so 16-bit caches run the instantiations they ran before.
FEATURE_FP8_CACHE = 512
# The backward reads the sink only through lse, and takes no paged cache.
FORWARD_ONLY_FEATURES = FEATURE_SINK | FEATURE_PAGED
# flash_decode's variants
DECODE_FEATURES = (FEATURE_WINDOW | FEATURE_SOFTCAP | FEATURE_ALIBI | FEATURE_SINK | FEATURE_HEAD_DIM_V | FEATURE_CACHE_INDEX
                   | FEATURE_FP8_CACHE)
ALL_FEATURES = (FEATURE_WINDOW | FEATURE_SOFTCAP | FEATURE_ALIBI | FEATURE_SINK | FEATURE_BIAS | FEATURE_VARLEN
                | FEATURE_HEAD_DIM_V)
FEATURE_NAMES = {FEATURE_WINDOW: "window", FEATURE_SOFTCAP: "softcap", FEATURE_ALIBI: "alibi",
                 FEATURE_SINK: "sink", FEATURE_BIAS: "bias", FEATURE_VARLEN: "varlen", FEATURE_HEAD_DIM_V: "head_dim_v",
                 FEATURE_CACHE_INDEX: "cache_index", FEATURE_PAGED: "paged",
                 FEATURE_FP8_CACHE: "fp8_cache"}


def cuda_defines() -> str:
    """The FEATURE_* bits as the kernels see them: _compile writes these lines into flash_interface.cuh,
    which every kernel file includes, so this module is their one definition."""
    return "".join(f"#define FEATURE_{name.upper()} {bit}\n" for bit, name in FEATURE_NAMES.items())

# Window sizes are clamped below 2^30 (past any sequence length): the kernels add them to the
# diagonal shift in int32.
UNBOUNDED = 2**30 - 1


@dataclasses.dataclass(frozen=True)
class Variant:
    """The checked variant options of one call (arrays still as given; ``on_device`` converts)."""

    causal: bool = False          # the kernels' right bound (causal, or a window's right size)
    window_right: int = 0
    window_left: int | None = None
    softcap: float = 0.0
    alibi_slopes: object = None   # (heads_q,) or (batch, heads_q)
    sink: object = None           # (heads_q,)
    bias: object = None           # broadcastable to (batch, heads_q, seqlen_q, seqlen_k)
    packed: object = None         # a ``Packed`` batch (cu_seqlens): variable-length sequences
    head_dim_v: bool = False      # v's head_dim differs from q's (FEATURE_HEAD_DIM_V)
    cache_index: bool = False     # flash_decode with cache_batch_idx or cache_leftpad (FEATURE_CACHE_INDEX)
    fp8_cache: bool = False       # flash_decode with an FP8 cache (FEATURE_FP8_CACHE)

    @property
    def plain(self) -> bool:
        """No variant beyond causal: the FlashParams defaults (window 0) already hold."""
        return self.flags == 0 and (not self.causal or self.window_right == 0)

    @property
    def flags(self) -> int:
        """Forward kernel flags."""
        return ((FEATURE_WINDOW if self.window_left is not None else 0)
                | (FEATURE_SOFTCAP if self.softcap > 0 else 0)
                | (FEATURE_ALIBI if self.alibi_slopes is not None else 0)
                | (FEATURE_SINK if self.sink is not None else 0)
                | (FEATURE_BIAS if self.bias is not None else 0)
                | (FEATURE_VARLEN if self.packed is not None else 0)
                | (FEATURE_HEAD_DIM_V if self.head_dim_v else 0)
                | (FEATURE_CACHE_INDEX if self.cache_index else 0)
                | (FEATURE_FP8_CACHE if self.fp8_cache else 0)
                | (FEATURE_PAGED if self.packed is not None and self.packed.block_table is not None else 0))

    @property
    def backward_flags(self) -> int:
        return self.flags & ~FORWARD_ONLY_FEATURES

    def on_device(self) -> Variant:
        """The same variant with its arrays as float32 CuPy arrays: slopes and sink contiguous (small
        copies), the bias as given when it is float32 (any strides) or else converted once (a
        float32 copy of the bias's own size)."""
        if self.alibi_slopes is None and self.sink is None and self.bias is None:
            return self   # most calls: dataclasses.replace costs microseconds on every call
        import cupy

        def prepared(x):
            return None if x is None else cupy.ascontiguousarray(x, dtype=cupy.float32)

        bias = self.bias
        if bias is not None and bias.dtype != cupy.float32:
            bias = bias.astype(cupy.float32)
        return dataclasses.replace(self, alibi_slopes=prepared(self.alibi_slopes), sink=prepared(self.sink), bias=bias)

    def device_arrays(self) -> tuple:
        """The arrays fill() points the kernels at (None where absent)."""
        packed = () if self.packed is None else (self.packed.cu_seqlens_q, self.packed.cu_seqlens_k,
                                                 self.packed.block_table)
        return (self.alibi_slopes, self.sink, self.bias) + packed

    def fill(self, record) -> None:
        """Write the mask and score-modifier fields of a FlashParams record."""
        record["window_right"] = self.window_right
        record["window_left"] = UNBOUNDED if self.window_left is None else self.window_left
        if self.softcap > 0:
            record["softcap"] = self.softcap
            record["softcap_inv"] = 1.0 / self.softcap
        if self.alibi_slopes is not None:
            record["alibi_slopes"] = self.alibi_slopes.data.ptr
            record["alibi_batch_stride"] = self.alibi_slopes.shape[-1] if self.alibi_slopes.ndim == 2 else 0
        if self.sink is not None:
            record["sink"] = self.sink.data.ptr
        if self.bias is not None:
            record["bias"] = self.bias.data.ptr
            record["bias_strides"] = broadcast_strides(self.bias)
        if self.packed is not None:
            self.packed.fill(record)


def broadcast_strides(array) -> list[int]:
    """Element strides of a float32 array seen as (batch, heads, seqlen_q, seqlen_k): leading axes
    it lacks and axes of size 1 get stride 0 (broadcast)."""
    shape = (1,) * (4 - array.ndim) + tuple(array.shape)
    strides = (0,) * (4 - array.ndim) + tuple(s // array.itemsize for s in array.strides)
    return [0 if n == 1 else s for n, s in zip(shape, strides)]


@dataclasses.dataclass(frozen=True)
class Packed:
    """A packed variable-length batch: sequence b has query rows [cu_seqlens_q[b], cu_seqlens_q[b+1])
    and key rows [cu_seqlens_k[b], cu_seqlens_k[b+1]) of q (total_q, heads, d) and k, v; with a
    block_table, k and v are a paged cache (pages, page_size, heads_kv, d) and key j of sequence b
    is row j % page_size of page block_table[b, j // page_size] (cu_seqlens_k then only counts)."""

    cu_seqlens_q: object   # int32 (batch + 1,), on the GPU
    cu_seqlens_k: object
    total_q: int
    total_k: int
    host_cu_seqlens_q: object   # NumPy copy (checked on the host)
    host_cu_seqlens_k: object = None
    block_table: object = None  # int32 (batch, pages per sequence), on the GPU (FEATURE_PAGED)
    page_shift: int = 0         # log2 of the page size

    def packed_row_of_padded(self, rows_per_sequence: int):
        """For each packed query row, its index in a (batch, rows_per_sequence) layout of the
        sequences' rows padded to a common length (``padded[..., index]`` gathers the packed rows)."""
        cu = self.host_cu_seqlens_q
        return numpy.concatenate([b * rows_per_sequence + numpy.arange(cu[b + 1] - cu[b]) for b in range(len(cu) - 1)])

    def fill(self, record) -> None:
        record["cu_seqlens_q"] = self.cu_seqlens_q.data.ptr
        record["cu_seqlens_k"] = self.cu_seqlens_k.data.ptr
        # lse (heads, total_q). delta and lse_log2 keep the dense (batch, heads, delta_stride)
        # layout, padded per sequence, so the backward reads them as it does for dense batches.
        record["lse_batch_stride"] = 0
        record["lse_head_stride"] = self.total_q
        if self.block_table is not None:
            record["block_table"] = self.block_table.data.ptr
            record["block_table_stride"] = self.block_table.shape[1]
            record["page_shift"] = self.page_shift


def describe(flags: int) -> str:
    return "+".join(name for bit, name in FEATURE_NAMES.items() if flags & bit) or "plain"


def _check_float_array(name: str, x, shapes: list[tuple], labels: str):
    if not (hasattr(x, "shape") and hasattr(x, "dtype") and hasattr(x, "ndim")):
        raise TypeError(f"{name} must be an array of shape {labels}, got {type(x).__name__}")
    if numpy.dtype(x.dtype).kind != "f":
        raise TypeError(f"{name} has dtype {x.dtype}; expected a floating dtype (float32)")
    if tuple(int(n) for n in x.shape) not in shapes:
        raise ValueError(f"{name} has shape {tuple(x.shape)}; expected {labels} = "
                         + " or ".join(str(s) for s in shapes))


def check_window(window_size) -> tuple[int, int]:
    if window_size is None:
        return (-1, -1)
    if isinstance(window_size, (str, bytes)) or not hasattr(window_size, "__len__") or len(window_size) != 2:
        raise TypeError(f"window_size must be a pair (left, right) of ints, got {window_size!r}")
    sizes = []
    for side, value in zip(("left", "right"), window_size):
        if isinstance(value, (bool, numpy.bool_)) or not isinstance(value, numbers.Integral):
            raise TypeError(f"window_size {side} must be an int, got {type(value).__name__}")
        if value < -1:
            raise ValueError(f"window_size {side} is {int(value)}; expected a size >= 0, or -1 for unbounded")
        sizes.append(int(value))
    return sizes[0], sizes[1]


def check_softcap(softcap) -> float:
    if isinstance(softcap, (bool, numpy.bool_)) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a real number, got {type(softcap).__name__}")
    value = float(softcap)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"softcap must be finite and >= 0 (0 turns it off), got {value}")
    return value


_PLAIN = {causal: Variant(causal=causal, window_right=0 if causal else UNBOUNDED) for causal in (False, True)}


def check_bias(bias, batch: int, heads_q: int, seqlen_q: int, seqlen_k: int) -> None:
    full = (batch, heads_q, seqlen_q, seqlen_k)
    if not (hasattr(bias, "shape") and hasattr(bias, "dtype") and hasattr(bias, "ndim")):
        raise TypeError(f"bias must be an array broadcastable to (batch, heads_q, seqlen_q, seqlen_k) = {full}, "
                        f"got {type(bias).__name__}")
    if numpy.dtype(bias.dtype).kind != "f" and dtype_name(bias.dtype) != "bfloat16":
        raise TypeError(f"bias has dtype {bias.dtype}; expected a floating dtype (float32, float16, bfloat16)")
    shape = tuple(int(n) for n in bias.shape)
    if len(shape) > 4 or any(n not in (1, want) for n, want in zip(shape[::-1], full[::-1])):
        raise ValueError(f"bias has shape {shape}, which does not broadcast to (batch, heads_q, seqlen_q, "
                         f"seqlen_k) = {full}")


def check_variant(batch: int, heads_q: int, causal: bool, *, window_size=None, softcap=0.0,
                  alibi_slopes=None, sink=None, bias=None, seqlen_q: int = 0, seqlen_k: int = 0,
                  packed: Packed | None = None, head_dim_v: bool = False) -> Variant:
    """Checks every feature keyword; raises TypeError/ValueError naming the argument. (MQA/GQA is
    a property of the shapes, not of the variant: ``AttentionShape.group``; a packed batch is
    checked by ``_checks.check_packed``.) seqlen_q, seqlen_k: what a bias must broadcast to;
    head_dim_v: whether v's head_dim differs from q's (the shapes say it: FEATURE_HEAD_DIM_V)."""
    if (window_size is None and alibi_slopes is None and sink is None and bias is None and packed is None
            and type(softcap) is float and softcap == 0.0 and not head_dim_v):
        return _PLAIN[causal]   # the plain call, without the per-call checks' overhead
    left, right = check_window(window_size)
    cap = check_softcap(softcap)
    if alibi_slopes is not None:
        _check_float_array("alibi_slopes", alibi_slopes, [(heads_q,), (batch, heads_q)],
                           "(heads_q,) or (batch, heads_q)")
    if sink is not None:
        _check_float_array("sink", sink, [(heads_q,)], "(heads_q,)")
    if bias is not None:
        if packed is not None:
            raise ValueError("bias is not supported with cu_seqlens_q/cu_seqlens_k (packed batches): "
                             "a per-sequence bias has no dense (batch, heads, seqlen_q, seqlen_k) shape")
        check_bias(bias, batch, heads_q, seqlen_q, seqlen_k)
    right_bounded = causal or right >= 0
    window_right = 0 if causal else (min(right, UNBOUNDED) if right >= 0 else UNBOUNDED)
    return Variant(causal=right_bounded, window_right=window_right,
                   window_left=min(left, UNBOUNDED) if left >= 0 else None,
                   softcap=cap, alibi_slopes=alibi_slopes, sink=sink, bias=bias, packed=packed,
                   head_dim_v=bool(head_dim_v))
