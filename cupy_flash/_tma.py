"""TMA tensor maps (``CUtensorMap``) for the Hopper kernels, encoded by the CUDA driver.

The driver's ``cuTensorMapEncodeTiled`` is reached through ctypes (libcuda), the way ``_launch``
reaches ``cuLaunchKernelEx``: it needs no extra dependency (cuda-python would be one), and a map is
128 opaque bytes the kernels take in a ``__grid_constant__`` parameter. Encoding costs a few
microseconds, so the launcher caches a call's maps by everything that enters them
(cupy_flash/forward.py): a training loop that reuses its buffers encodes each map once.
"""

from __future__ import annotations

import ctypes
import functools
import typing

from ._launch import driver_function

MAP_BYTES = 128
# kernels_cu/forward_sm90.cu: ForwardSm90Maps, the q, k, v (V^T for FP8) and o maps of the Hopper
# forward, bf16 and FP8 alike (tests/test_compile.py holds them equal)
FORWARD_MAPS_BYTES = 4 * MAP_BYTES
# cuda.h enums
DATA_TYPES = {"float16": 6, "bfloat16": 9, "float32": 7, "uint8": 0}   # uint8: e4m3 bits (the FP8 forward)
INTERLEAVE_NONE = 0
SWIZZLE_NONE, SWIZZLE_64B, SWIZZLE_128B = 0, 2, 3
L2_PROMOTION_128B = 2
OOB_FILL_ZEROS = 0   # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE: elements outside the tensor read as zero

SWIZZLE_BYTES = 128     # a swizzled row: 64 elements of a 16-bit type (kernels_cu/sm90_mma.cuh)
# Rows of an O (or dQ) store box: one consumer warpgroup's (kernels_cu/forward_sm90.cu, backward_dq_sm90.cuh).
STORE_ROWS = 64


class TensorMapError(RuntimeError):
    pass


@functools.lru_cache(maxsize=None)
def _encoder():
    encode = driver_function("cuTensorMapEncodeTiled")
    if encode is None:
        return None
    u32, u64 = ctypes.c_uint32, ctypes.c_uint64
    encode.argtypes = [ctypes.c_void_p, ctypes.c_int, u32, ctypes.c_void_p, ctypes.POINTER(u64), ctypes.POINTER(u64),
                       ctypes.POINTER(u32), ctypes.POINTER(u32), ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    encode.restype = ctypes.c_int
    return encode


def encode_tiled(dtype: str, address: int, dims: tuple, byte_strides: tuple, box: tuple, swizzle: int = SWIZZLE_128B) -> bytes:
    """A tensor map of a tensor of ``dims`` elements (innermost first) at ``address``, with the byte
    strides of dims 1.. (``byte_strides``), read in boxes of ``box`` elements, 128-byte swizzled
    (or ``swizzle``: SWIZZLE_64B)."""
    encode = _encoder()
    if encode is None:
        raise TensorMapError("the CUDA driver library (libcuda) has no cuTensorMapEncodeTiled")
    rank = len(dims)
    buffer = ctypes.create_string_buffer(MAP_BYTES + 64)
    aligned = (ctypes.addressof(buffer) + 63) & ~63   # the driver writes a 64-byte-aligned CUtensorMap
    u32, u64 = ctypes.c_uint32, ctypes.c_uint64
    result = encode(aligned, DATA_TYPES[dtype], rank, address, (u64 * rank)(*dims), (u64 * (rank - 1))(*byte_strides),
                    (u32 * rank)(*box), (u32 * rank)(*([1] * rank)), INTERLEAVE_NONE, swizzle, L2_PROMOTION_128B,
                    OOB_FILL_ZEROS)
    if result != 0:
        raise TensorMapError(f"cuTensorMapEncodeTiled returned {result} for {dtype} dims {dims} strides "
                             f"{byte_strides} box {box} at {address:#x}")
    return ctypes.string_at(aligned, MAP_BYTES)


class Layout(typing.NamedTuple):
    """What a tensor map takes of an array but its address: shape, byte strides, item size (a plan
    keeps its arrays' layouts and encodes maps at new addresses)."""
    shape: tuple
    strides: tuple
    itemsize: int


def layout_of(x) -> Layout:
    return Layout(tuple(int(n) for n in x.shape), tuple(int(s) for s in x.strides), x.dtype.itemsize)


def map_strides(x, packed: bool) -> tuple:
    """The byte strides of dims 1.. of attention_map_at's 4-D view of x (an array or a Layout):
    (seqlen, heads, batch). An axis of size one is never stepped along, so whatever stride it has (0
    after ``x[None]``, anything from a framework's view) is replaced by a valid one: the driver wants
    positive multiples of 16."""
    layout = x if isinstance(x, Layout) else layout_of(x)
    shape, strides = layout.shape, layout.strides
    if packed:
        total, heads, head_dim = shape
        sizes, strides = (total, heads, 1), (strides[0], strides[1], strides[0] * total)
    else:
        _, seqlen, heads, head_dim = shape
        sizes, strides = (seqlen, heads, shape[0]), (strides[1], strides[2], strides[0])
    row_bytes = -(-head_dim * layout.itemsize // 16) * 16
    return tuple(int(s) if n > 1 else row_bytes for n, s in zip(sizes, strides))


def attention_map_at(address: int, layout: Layout, dtype: str, rows: int, packed: bool, row_bytes: int = SWIZZLE_BYTES,
                     swizzled: bool = True) -> bytes:
    """The map of q, k, v or o (batch, seqlen, heads, head_dim), or packed (total, heads, head_dim), of
    ``layout`` at ``address``, as a 4-D tensor (head_dim, seqlen, heads, batch) in boxes of 128 bytes
    of head_dim (64 elements of a 16-bit type, 32 of float32: the backward's dq_accum) x ``rows``
    rows of one head: what the Hopper kernels load (or store, or add) at once. Past the tensor's
    edges (head_dim, seqlen, batch) a load reads zeros and a store or add writes nothing.
    ``row_bytes`` 64: boxes of 64 bytes, 64-byte swizzled (e4m3 at d <= 64: operand_row_elements,
    kernels_cu/sm90_mma.cuh). ``swizzled`` False: boxes laid out as they are (an FP8 MLA cache's raw
    rows of 64 bytes: kernels_cu/decode_sm90.cu)."""
    if packed:
        total, heads, head_dim = layout.shape
        dims = (head_dim, total, heads, 1)
    else:
        batch, seqlen, heads, head_dim = layout.shape
        dims = (head_dim, seqlen, heads, batch)
    assert layout.strides[-1] == layout.itemsize
    swizzle = {SWIZZLE_BYTES: SWIZZLE_128B, 64: SWIZZLE_64B}[row_bytes] if swizzled else SWIZZLE_NONE
    return encode_tiled(dtype, address, dims, map_strides(layout, packed), (row_bytes // layout.itemsize, rows, 1, 1), swizzle)


def maps_supported(x) -> bool:
    """Whether TMA can read x as attention_map_at does: a 16-byte-aligned base and strides that are
    positive multiples of 16 bytes below 2^40 (the driver refuses others)."""
    strides = map_strides(x, packed=x.ndim == 3)
    return (x.data.ptr % 16 == 0 and min(strides) > 0 and max(strides) < 2**40
            and not any(s % 16 for s in strides))
