"""The kernels' single argument, ``FlashParams``: one table of its fields (``FIELDS``), from which
both the NumPy record the launch code fills (``PARAMS_DTYPE``) and the CUDA struct the kernels read
(``cuda_struct``, which _compile writes into flash_interface.cuh, included by kernels_cu/common.cuh)
are made, so the two cannot disagree.

Every field is 8 bytes or a pair of 4-byte floats, so NumPy's packed layout equals the C layout.
All offsets are 64-bit: batch * seqlen * heads * head_dim passes 2^31 at realistic sizes.
"""

from __future__ import annotations

import ctypes
import math
import struct

import numpy

from ._streams import record_kernel_arrays

# FlashParams, in order: (field, C type, elements). Tensors of shape (batch, seqlen, heads,
# head_dim) carry element strides {batch, row, head} in `<name>_strides` (a paged cache: {page,
# row, head}); the head_dim stride is 1. lse is float32 (batch, heads, seqlen_q), contiguous; delta
# and lse_log2 are float32 (batch, heads, delta_stride) with delta_stride >= seqlen_q (padded rows
# for the tensor-core backward, which loads them in 16-byte chunks).
FIELDS = (
    ("q", "const void*", 1), ("k", "const void*", 1), ("v", "const void*", 1), ("o", "void*", 1),
    ("lse", "float*", 1), ("dout", "const void*", 1), ("delta", "float*", 1),
    ("dq_accum", "float*", 1),            # float32 (batch, seqlen_q, heads, head_dim); null when unused
    ("dq", "void*", 1), ("dk", "void*", 1), ("dv", "void*", 1),
    ("lse_log2", "float*", 1),            # tensor-core backward: lse * log2(e), +inf for rows that see no key
    ("dq_semaphore", "int*", 1),          # tensor-core backward, deterministic: one counter per query block
    ("alibi_slopes", "const float*", 1),  # FEATURE_ALIBI: slope of (b, h) at b * alibi_batch_stride + h
    ("sink", "const float*", 1),          # FEATURE_SINK: one logit per query head
    ("dk_expanded", "const void*", 1),    # GQA backward: per-query-head dK, dV, float32 (batch, seqlen_k, heads, d)
    ("dv_expanded", "const void*", 1),
    ("bias", "const float*", 1),          # FEATURE_BIAS: float32, element (b, h, i, j) at bias_strides . (b, h, i, j)
    ("dbias", "float*", 1),               # FEATURE_BIAS backward: float32 gradient of the bias; null when not wanted
    ("cu_seqlens_q", "const int*", 1),    # FEATURE_VARLEN: sequence b has rows [cu[b], cu[b + 1]) of the packed tensors
    ("cu_seqlens_k", "const int*", 1),
    ("k_new", "const void*", 1),          # flash_decode: keys / values appended at each sequence's cache end
    ("v_new", "const void*", 1),
    ("cache_seqlens", "const int*", 1),   # flash_decode: keys already in sequence b's cache (before k_new)
    ("block_table", "const int*", 1),     # paged cache: page of key j of b at b * block_table_stride + j / page size
    ("o_partial", "void*", 1),            # split-KV: per split normalised O (splits, batch, seqlen_q, heads, d)
    ("lse_partial", "float*", 1),         #   and its lse (splits, batch, heads, seqlen_q); -inf where a split saw no key
    *((f"{name}_strides", "long long", 3) for name in ("q", "k", "v", "o", "dout", "dq_accum", "dq", "dk", "dv",
                                                       "k_new", "v_new")),
    ("bias_strides", "long long", 4),     # 0 along the dimensions the bias broadcasts over
    ("dbias_strides", "long long", 4),
    *((name, "long long", 1) for name in ("batch", "heads", "seqlen_q", "seqlen_k", "head_dim")),
    ("delta_stride", "long long", 1),     # elements between the (batch, head) rows of delta and lse_log2
    ("group", "long long", 1),            # query heads per K/V head (GQA/MQA; 1 otherwise): K/V head = h / group
    ("window_right", "long long", 1),     # causal: key j visible from query i only if j - i <= shift + window_right
    ("window_left", "long long", 1),      # FEATURE_WINDOW: ... and only if j - i >= shift - window_left
    ("alibi_batch_stride", "long long", 1),   # 0 for slopes of shape (heads,), heads for (batch, heads)
    ("lse_batch_stride", "long long", 1),     # lse of (b, h, row) at b * lse_batch_stride + h * lse_head_stride + row
    ("lse_head_stride", "long long", 1),      #   (varlen: batch stride 0, rows packed: (heads, total_q))
    ("delta_batch_stride", "long long", 1),   # delta, lse_log2 of (b, h, row) at b * this + h * delta_stride + row
    ("dbias_atomic", "long long", 1),         # nonzero: several (b, h, i, j) share a dbias element
    ("packed_sequences", "long long", 1),     # row kernels of a packed batch: its number of sequences
    ("block_table_stride", "long long", 1),   # flash_decode: pages per sequence in block_table (paged cache)
    ("page_shift", "long long", 1),           #   log2 of the page size (paged cache)
    ("cache_capacity", "long long", 1),       #   keys one sequence's cache holds (pages x page size, or its rows)
    ("seqlen_new", "long long", 1),           #   rows of k_new / v_new (0 without them)
    ("num_splits", "long long", 1),           # split-KV: key ranges per (batch, K/V head, row block)
    ("keys_per_split", "long long", 1),
    ("softmax_scale", "float", 1),
    ("scale_log2", "float", 1),               # softmax_scale * log2(e): scores go straight into exp2
    ("softcap", "float", 1),                  # FEATURE_SOFTCAP: logits become softcap * tanh(logit / softcap)
    ("softcap_inv", "float", 1),
    ("q_descale", "const float*", 1),     # FP8 forward: float32 (batch, heads_q): q's values are decode(q) x this
    ("k_descale", "const float*", 1),     #   and (batch, heads_kv) for k and v
    ("v_descale", "const float*", 1),
    ("vt_rows", "const int*", 1),         # FP8 forward, packed: sequence b's first row of V^T (a multiple of 32)
    ("head_dim_v", "long long", 1),       # v's, o's, dout's and dv's head_dim (head_dim: q's, k's, dq's, dk's)
    ("cache_batch_idx", "const int*", 1),   # flash_decode, FEATURE_CACHE_INDEX: sequence b's cache is row [b] of
    ("cache_leftpad", "const int*", 1),     #   the cache (null: b), its keys from row [b] (null: 0)
    ("cache_batch", "long long", 1),        #   the cache's rows (cache_batch_idx outside them: no key seen)
)

POINTER_FIELDS = tuple(name for name, c_type, _ in FIELDS if c_type.endswith("*"))
# The tensors whose element strides the record carries (_strides fields of 3).
STRIDED_FIELDS = tuple(name[:-len("_strides")] for name, _, count in FIELDS if name.endswith("_strides") and count == 3)
_NUMPY_TYPES = {"long long": numpy.int64, "float": numpy.float32}
PARAMS_DTYPE = numpy.dtype([(name, numpy.uint64) if c_type.endswith("*") else
                            (name, _NUMPY_TYPES[c_type], (count,)) if count > 1 else (name, _NUMPY_TYPES[c_type])
                            for name, c_type, count in FIELDS])


def cuda_struct() -> str:
    """FlashParams as CUDA C++, field for field as PARAMS_DTYPE (with its size checked)."""
    lines = ["struct FlashParams {"]
    lines += [f"    {c_type} {name}{f'[{count}]' if count > 1 else ''};" for name, c_type, count in FIELDS]
    lines += ["};", f'static_assert(sizeof(FlashParams) == {PARAMS_DTYPE.itemsize}, "FlashParams is not PARAMS_DTYPE");']
    return "\n".join(lines) + "\n"


def make_params(shape, softmax_scale: float, delta_stride: int | None = None, variant=None,
                **arrays) -> numpy.ndarray:
    """Fill a params record. ``arrays`` maps field names to CuPy arrays (or None for unused fields);
    ``delta_stride`` defaults to seqlen_q (unpadded delta rows); ``variant`` (a
    ``_features.Variant``) fills the mask and score-modifier fields."""
    record = numpy.zeros(1, dtype=PARAMS_DTYPE)
    record_kernel_arrays(arrays.values())
    for name, array in arrays.items():
        if name not in POINTER_FIELDS:
            raise KeyError(name)
        if array is None:
            continue
        record[name] = array.data.ptr
        if name in STRIDED_FIELDS:
            itemsize = array.dtype.itemsize
            if array.ndim == 3:   # packed varlen (total, heads, head_dim): batch stride 0, rows from cu_seqlens
                assert array.strides[2] == itemsize, (name, array.strides)
                record[name + "_strides"] = [0] + [s // itemsize for s in array.strides[:2]]
            else:
                assert array.ndim == 4 and array.strides[3] == itemsize, (name, array.strides)
                record[name + "_strides"] = [s // itemsize for s in array.strides[:3]]
    record["batch"] = shape.batch
    record["heads"] = shape.heads
    record["seqlen_q"] = shape.seqlen_q
    record["seqlen_k"] = shape.seqlen_k
    record["head_dim"] = shape.head_dim
    record["head_dim_v"] = shape.head_dim_v
    record["delta_stride"] = shape.seqlen_q if delta_stride is None else delta_stride
    record["delta_batch_stride"] = shape.heads * record["delta_stride"][0]
    record["lse_head_stride"] = shape.seqlen_q
    record["lse_batch_stride"] = shape.heads * shape.seqlen_q
    record["softmax_scale"] = softmax_scale
    record["scale_log2"] = softmax_scale * math.log2(math.e)
    record["group"] = shape.group
    if variant is not None and not variant.plain:
        variant.fill(record)
        record_kernel_arrays(variant.device_arrays())
    return record


class PointerRecord:
    """A filled record whose pointer fields are written again on each launch: a cached launch plan
    holds one per params record it launches with. ``bindings`` maps each pointer field to the name
    of the array it takes (a plan's arrays are named once for all its records: the GQA sum's ``dk``
    field takes the final ``dk``, the main kernel's takes the per-query-head ``dk_heads``)."""

    def __init__(self, record: numpy.ndarray, bindings: dict):
        self.bytes = record.tobytes()
        fields = sorted(bindings, key=lambda name: PARAMS_DTYPE.fields[name][1])
        # Runs of adjacent bound fields, each written by one pack_into (pad bytes would be written
        # as zeros: the unbound fields between, such as bias or alibi_slopes, keep their bytes).
        self._runs = []   # (offset, struct of the run, array names)
        for field in fields:
            offset = PARAMS_DTYPE.fields[field][1]
            if self._runs and self._runs[-1][0] + 8 * len(self._runs[-1][1]) == offset:
                self._runs[-1][1].append(bindings[field])
            else:
                self._runs.append((offset, [bindings[field]]))
        self._runs = tuple((offset, struct.Struct(f"<{len(names)}Q"), tuple(names)) for offset, names in self._runs)

    def filled(self, addresses: dict):
        """A ctypes buffer of the record with ``addresses`` (array names to device addresses; None or
        a name left out: 0) in the bound fields."""
        buffer = ctypes.create_string_buffer(self.bytes, len(self.bytes))
        for offset, layout, names in self._runs:
            layout.pack_into(buffer, offset, *(addresses.get(name) or 0 for name in names))
        return buffer


def as_argument(record: numpy.ndarray) -> numpy.ndarray:
    """The record as a kernel argument: the same bytes as one unstructured void element. CuPy takes
    a NumPy argument's address from ``__array_interface__``, which for the record's structured dtype
    rebuilds the description of every field on each call: 40% of a call's host time (measured on
    the H100: forward 182 us against 139 us before the variants' fields). (CuPy passes only size-one
    arrays by value, so a uint8 view will not do.)"""
    return record.view(_OPAQUE)


_OPAQUE = numpy.dtype((numpy.void, PARAMS_DTYPE.itemsize))
