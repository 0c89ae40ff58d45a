"""The kernels' single argument: ``FlashParams`` from ``kernels_cu/common.cuh``, as a NumPy record.

Every field is 8 bytes or a pair of 4-byte floats, so NumPy's packed layout equals the C layout;
``FLASH_PARAMS_BYTES`` is passed to the compiler and checked there with a ``static_assert``.
"""

from __future__ import annotations

import ctypes
import math
import struct

import numpy

from ._streams import record_kernel_arrays

POINTER_FIELDS = ("q", "k", "v", "o", "lse", "dout", "delta", "dq_accum", "dq", "dk", "dv", "lse_log2",
                  "dq_semaphore", "alibi_slopes", "sink", "dk_expanded", "dv_expanded", "bias", "dbias",
                  "cu_seqlens_q", "cu_seqlens_k", "k_new", "v_new", "cache_seqlens", "block_table", "o_partial",
                  "lse_partial")
# Tensors of shape (batch, seqlen, heads, head_dim) and their element strides {batch, row, head}
# (a paged cache: {page, row, head}).
STRIDED_FIELDS = ("q", "k", "v", "o", "dout", "dq_accum", "dq", "dk", "dv", "k_new", "v_new")

PARAMS_DTYPE = numpy.dtype(
    [(name, numpy.uint64) for name in POINTER_FIELDS]
    + [(name + "_strides", numpy.int64, (3,)) for name in STRIDED_FIELDS]
    + [(name + "_strides", numpy.int64, (4,)) for name in ("bias", "dbias")]
    + [(name, numpy.int64) for name in ("batch", "heads", "seqlen_q", "seqlen_k", "head_dim", "delta_stride",
                                        "group", "window_right", "window_left", "alibi_batch_stride",
                                        "lse_batch_stride", "lse_head_stride", "delta_batch_stride",
                                        "dbias_atomic", "packed_sequences", "block_table_stride", "page_shift",
                                        "cache_capacity", "seqlen_new", "num_splits", "keys_per_split")]
    + [(name, numpy.float32) for name in ("softmax_scale", "scale_log2", "softcap", "softcap_inv")]
)


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
