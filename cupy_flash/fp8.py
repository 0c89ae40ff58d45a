"""FP8 (e4m3, e5m2) values without FP8 dtypes: rounding, the bit encoding, and ``quantize_fp8``.

CuPy 14 holds no FP8 dtype (``ml_dtypes.float8_*`` arrays, and PyTorch's through DLPack, are
refused), so FP8 data moves as uint8 arrays of the formats' bits: ``x8.view(ml_dtypes.float8_e4m3fn)``
reads them on NumPy, ``torch.from_dlpack(x8).view(torch.float8_e4m3fn)`` on PyTorch. Everything here
is array arithmetic on NumPy or CuPy arrays alike (float64 inside), so the rounding the references and
the accuracy study use is the same code on either, and agrees with ml_dtypes and the hardware's
``cvt.rn.satfinite`` value for value (tests/test_fp8.py).

Formats (OCP FP8): e4m3 is ``float8_e4m3fn`` (bias 7, no infinity, largest 448, subnormals from 2^-9);
e5m2 is ``float8_e5m2`` (bias 15, largest 57344, subnormals from 2^-16). Rounding is to nearest, ties
to even, and saturates to the largest finite value (the kernels' conversions are ``satfinite``);
NaN stays NaN.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math

import numpy

from ._dtypes import as_float
from ._streams import on_stream


@dataclasses.dataclass(frozen=True)
class Fp8Format:
    name: str
    mantissa_bits: int
    exponent_bias: int
    min_exponent: int     # of the normal numbers: below it, subnormals with quantum 2^(min_exponent - mantissa_bits)
    largest: float
    nan_bits: int         # the canonical NaN's bits (sign clear)


FORMATS = {
    "e4m3": Fp8Format("e4m3", 3, 7, -6, 448.0, 0x7F),
    "e5m2": Fp8Format("e5m2", 2, 15, -14, 57344.0, 0x7E),
}


def fp8_format(fmt) -> Fp8Format:
    """The format named ``fmt`` ("e4m3" or "e5m2"), or ValueError naming it."""
    if isinstance(fmt, Fp8Format):
        return fmt
    if fmt not in FORMATS:
        raise ValueError(f"fmt is {fmt!r}; expected one of {', '.join(repr(n) for n in FORMATS)}")
    return FORMATS[fmt]


def _xp(x):
    import cupy

    return cupy.get_array_module(x)


def _binade(magnitude, xp, spec: Fp8Format):
    """The exponent e of 2^e <= magnitude < 2^(e+1), clamped below at the normals' (so subnormals
    share the smallest normal binade's quantum); magnitude > 0 where it matters."""
    _, exponent = xp.frexp(magnitude)   # magnitude = m * 2^exponent, 0.5 <= m < 1
    return xp.maximum(exponent.astype(xp.int32) - 1, spec.min_exponent)


def round_fp8(x, fmt="e4m3"):
    """``x`` rounded to the nearest value of the FP8 format (ties to even), saturated to its largest
    finite value, as float64 (NaN stays NaN). Exact: the quotient by a power of two and ``rint``
    (ties to even) in float64 lose nothing for the formats' 2-3 mantissa bits."""
    spec = fp8_format(fmt)
    xp = _xp(x)
    x = xp.asarray(x, dtype=xp.float64)
    magnitude = xp.abs(x)
    finite = xp.isfinite(magnitude)
    safe = xp.where(finite & (magnitude > 0), magnitude, 1.0)
    quantum = xp.ldexp(1.0, _binade(safe, xp, spec) - spec.mantissa_bits)
    rounded = xp.minimum(xp.rint(safe / quantum) * quantum, spec.largest)
    rounded = xp.where(magnitude > 0, rounded, 0.0)
    rounded = xp.where(finite, rounded, xp.where(xp.isnan(x), xp.nan, spec.largest))
    return xp.copysign(rounded, x)


def encode_fp8(x, fmt="e4m3"):
    """The FP8 bits (uint8) of ``x`` rounded as ``round_fp8`` does."""
    spec = fp8_format(fmt)
    xp = _xp(x)
    rounded = round_fp8(x, spec)
    magnitude = xp.abs(rounded)
    safe = xp.where(magnitude > 0, magnitude, 1.0)
    exponent = _binade(safe, xp, spec)
    normal = safe >= 2.0 ** spec.min_exponent
    # normal: (exponent + bias, the mantissa past the leading 1); subnormal: (0, magnitude / quantum)
    mantissa = xp.where(normal, xp.ldexp(safe, spec.mantissa_bits - exponent) - (1 << spec.mantissa_bits),
                        xp.ldexp(safe, spec.mantissa_bits - spec.min_exponent))
    field = xp.where(normal, exponent + spec.exponent_bias, 0)
    bits = (field.astype(xp.int32) << spec.mantissa_bits) | xp.rint(mantissa).astype(xp.int32)
    bits = xp.where(magnitude > 0, bits, 0)
    bits = xp.where(xp.isnan(rounded), spec.nan_bits, bits)
    return (bits | (xp.signbit(rounded).astype(xp.int32) << 7)).astype(xp.uint8)


def decode_fp8(bits, fmt="e4m3"):
    """The float64 values of FP8 ``bits`` (uint8)."""
    spec = fp8_format(fmt)
    xp = _xp(bits)
    bits = xp.asarray(bits)
    if bits.dtype != numpy.uint8:
        raise TypeError(f"bits has dtype {bits.dtype}; expected uint8 (FP8 data as its bits)")
    code = bits.astype(xp.int32)
    field = (code >> spec.mantissa_bits) & ((1 << (7 - spec.mantissa_bits)) - 1)
    mantissa = (code & ((1 << spec.mantissa_bits) - 1)).astype(xp.float64)
    normal = xp.ldexp(1.0 + mantissa / (1 << spec.mantissa_bits), field - spec.exponent_bias)
    subnormal = xp.ldexp(mantissa, spec.min_exponent - spec.mantissa_bits)
    values = xp.where(field > 0, normal, subnormal)
    if spec.name == "e4m3":   # 0x7F / 0xFF: NaN (no infinities)
        values = xp.where((code & 0x7F) == 0x7F, xp.nan, values)
    else:                     # exponent field all ones: infinity (mantissa 0) or NaN
        top = field == (1 << (7 - spec.mantissa_bits)) - 1
        values = xp.where(top, xp.where(mantissa == 0, xp.inf, xp.nan), values)
    return xp.where(code >> 7 == 1, -values, values)


def hadamard_rotation(head_dim: int, seed: int = 0):
    """An orthogonal ``(head_dim, head_dim)`` float64 NumPy matrix R = diag(random signs) @ H, H
    block-diagonal with normalised Sylvester-Hadamard blocks of the largest power of two dividing
    head_dim (the whole of it for 64, 128, 256). ``q @ R`` and ``k @ R`` have the scores of q and k
    (R is orthogonal) but spread an outlier channel over the block, which FP8 rounds far better
    (FlashAttention-3's incoherent processing). q and k must take the same R (the same seed); v
    does not take one."""
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
        raise ValueError(f"head_dim is {head_dim!r}; expected a positive int")
    block = head_dim & -head_dim   # the largest power of two dividing it
    hadamard = numpy.ones((1, 1))
    while hadamard.shape[0] < block:
        hadamard = numpy.block([[hadamard, hadamard], [hadamard, -hadamard]])
    blocks = numpy.kron(numpy.eye(head_dim // block), hadamard / math.sqrt(block))
    signs = numpy.random.default_rng(seed).choice((-1.0, 1.0), size=head_dim)
    return signs[:, None] * blocks


# The FP8 attention scheme (docs/fp8.md), which the FP8 references round as:
P_SCALE = 2.0 ** 8      # P in [0, 1] is rounded to e4m3 as P x 2^8 (exact), clear of e4m3's subnormals
DS_TILE = (128, 128)    # dS is rounded to e4m3 with a scale per tile of (query rows, key columns)


def group_descale(x, axes, fmt="e4m3"):
    """The descale of each group of ``x`` reduced over ``axes`` (kept as size-1 axes): the group's
    largest magnitude over the format's largest value, so the group spans the format's range; 1
    for an all-zero group. float64."""
    spec = fp8_format(fmt)
    xp = _xp(x)
    amax = xp.abs(x).max(axis=axes, keepdims=True)
    return xp.where(amax > 0, amax / spec.largest, 1.0)


def round_fp8_groups(x, fmt="e4m3", axes=(-2, -1)):
    """``x`` rounded to the FP8 format with one scale per group over ``axes`` (group_descale's),
    as float64: an oracle per-group scale, as a pass over the data could compute."""
    xp = _xp(x)
    x = xp.asarray(x, dtype=xp.float64)
    scale = group_descale(x, axes, fmt)
    return round_fp8(x / scale, fmt) * scale


def round_fp8_tiles(x, fmt="e4m3", tile=DS_TILE):
    """``x`` (..., rows, columns) rounded to the FP8 format with a scale per ``tile`` block
    (round_fp8_groups over the block): the rounding a kernel holding the block in registers can
    apply. float64."""
    xp = _xp(x)
    x = xp.asarray(x, dtype=xp.float64)
    out = xp.empty_like(x)
    for i in range(0, x.shape[-2], tile[0]):
        for j in range(0, x.shape[-1], tile[1]):
            out[..., i:i + tile[0], j:j + tile[1]] = round_fp8_groups(x[..., i:i + tile[0], j:j + tile[1]], fmt)
    return out


GRANULARITIES = ("head", "tensor")


@on_stream
def quantize_fp8(x, *, fmt="e4m3", granularity="head", rotation=None):
    """``x`` in FP8 with a descale factor per group: ``(x8, descale)`` with ``x8`` uint8 bits of
    ``x`` rotated (``x @ rotation`` where given) and divided by its group's descale, rounded as
    ``round_fp8`` does, so that ``decode_fp8(x8) * descale`` approximates ``x @ rotation``.

    x: (batch, seqlen, heads, head_dim), float16 / bfloat16 / float32 / float64, NumPy or CuPy.
    fmt: "e4m3" (inputs) or "e5m2". granularity: "head", a descale per (batch, head) (FlashAttention-3's
    per (batch, kv head) for k and v), descale float32 (batch, heads); "tensor", one for the whole
    array, descale float32 (1, 1). A group's descale is its largest magnitude over the format's
    largest value (1 where the group is all zero), so the group spans the format's range.
    rotation: None, or a (head_dim, head_dim) orthogonal matrix such as ``hadamard_rotation(d, seed)``.
    On CuPy arrays of the kernels' dtypes with e4m3, per-head descales, no rotation and head_dim a
    multiple of 16, two kernels compute the same bits (families.rows.quantize_e4m3).
    """
    spec = fp8_format(fmt)
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity is {granularity!r}; expected one of {', '.join(map(repr, GRANULARITIES))}")
    if getattr(x, "ndim", None) != 4:
        raise ValueError(f"x must have 4 dimensions (batch, seqlen, heads, head_dim), got shape "
                         f"{tuple(getattr(x, 'shape', ()))}")
    from ._checks import dtype_name

    if dtype_name(x.dtype) is None and numpy.dtype(x.dtype) != numpy.float64:
        raise TypeError(f"x has dtype {x.dtype}; expected float16, bfloat16, float32 or float64")
    xp = _xp(x)
    if (xp is not numpy and fmt == "e4m3" and granularity == "head" and rotation is None and dtype_name(x.dtype)
            and x.size and x.shape[3] % 16 == 0):
        from ._checks import kernel_ready
        from .families import rows

        if x.shape[1] <= rows.max_quantize_rows():   # the same bits by two kernels: no float64 copies
            with x.device:
                bits, descale = rows.quantize_e4m3(kernel_ready(x))
            if not bool(xp.isfinite(descale).all()):
                raise ValueError("x holds inf or NaN; FP8 quantisation needs finite values")
            return bits, descale
    values = as_float(x, xp, xp.float64)
    if rotation is not None:
        rotation = xp.asarray(rotation, dtype=xp.float64)
        d = int(x.shape[3])
        if rotation.shape != (d, d):
            raise ValueError(f"rotation has shape {tuple(rotation.shape)}; expected (head_dim, head_dim) = ({d}, {d})")
        values = values @ rotation
    descale = group_descale(values, (1, 3) if granularity == "head" else (0, 1, 2, 3), spec)
    if not bool(xp.isfinite(descale).all()):
        raise ValueError("x holds inf or NaN; FP8 quantisation needs finite values")
    descale = descale.astype(xp.float32)
    bits = encode_fp8(values / descale.astype(xp.float64), spec)
    descale = descale.reshape(x.shape[0], x.shape[2]) if granularity == "head" else descale.reshape(1, 1)
    return bits, descale


def dequantize_fp8(x8, descale, fmt="e4m3"):
    """float64 ``decode_fp8(x8) * descale`` for ``quantize_fp8``'s (x8, descale) (either granularity)."""
    xp = _xp(x8)
    values = decode_fp8(x8, fmt)
    descale = xp.asarray(descale, dtype=xp.float64)
    if descale.shape == (1, 1):
        return values * descale[0, 0]
    if getattr(x8, "ndim", None) != 4 or descale.shape != (x8.shape[0], x8.shape[2]):
        raise ValueError(f"descale has shape {tuple(descale.shape)}; expected (batch, heads) of x8 "
                         f"{tuple(getattr(x8, 'shape', ()))} or (1, 1)")
    return values * descale[:, None, :, None]


# ---------------------------------------------------------------------------------------------
# FP8 attention calls: what the references and the kernels both accept.

# The feature keywords FP8 calls take (causal and GQA/MQA besides).
FP8_FEATURES = ("window_size", "sink", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")


@dataclasses.dataclass(frozen=True)
class Fp8Call:
    batch: int
    heads: int
    heads_kv: int
    packed: bool


def check_fp8_call(function: str, arrays: dict, descales: dict, features: dict) -> Fp8Call | None:
    """None where no array is FP8 and no descale is given; else the call's batch, heads and whether
    it is packed, once every check passed. FP8 inputs are uint8 arrays of e4m3 bits
    (``quantize_fp8``'s) with q_descale (batch, heads_q) or (batch, heads_kv) and k_descale,
    v_descale (batch, heads_kv), float, finite and positive (packed batches: batch = len(cu_seqlens)
    - 1). TypeError / ValueError naming the argument: FP8 mixed with other dtypes, a descale
    missing, of the wrong shape, not finite or not positive (read back: a GPU descale costs a
    synchronisation), a variant FP8 does not take."""
    fp8 = [name for name, x in arrays.items() if getattr(x, "dtype", None) == numpy.uint8]
    given = [name for name, x in descales.items() if x is not None]
    if not fp8 and not given:
        return None
    if len(fp8) != len(arrays):
        other = next(name for name in arrays if name not in fp8)
        dtype = getattr(arrays[other], "dtype", type(arrays[other]).__name__)
        reason = f"{fp8[0]} is FP8 (uint8 bits of e4m3)" if fp8 else f"{given[0]} is given"
        raise TypeError(f"{function}: {other} has dtype {dtype} but {reason}; FP8 calls take q, k and v all in FP8")
    for name, descale in descales.items():
        if descale is None:
            raise ValueError(f"{name} is missing: FP8 inputs (uint8 bits of e4m3) need q_descale, k_descale and v_descale")
    unsupported = sorted(n for n, x in features.items() if n not in FP8_FEATURES and x is not None
                         and not (n == "softcap" and not x))
    if unsupported:
        raise ValueError(f"{unsupported[0]} is not supported with FP8 inputs (they take causal, window_size, sink, "
                         "GQA/MQA and packed batches)")
    q, k = arrays["q"], arrays["k"]
    packed = features.get("cu_seqlens_q") is not None or features.get("cu_seqlens_k") is not None
    rank = 3 if packed else 4
    for name, x in arrays.items():
        if x.ndim != rank:
            layout = "(total_tokens, heads, head_dim) with cu_seqlens" if packed else "(batch, seqlen, heads, head_dim)"
            raise ValueError(f"{name} must have {rank} dimensions {layout}, got shape {tuple(x.shape)}")
    heads, heads_kv = int(q.shape[-2]), int(k.shape[-2])
    if heads_kv < 1 or heads % heads_kv:
        raise ValueError(f"k has {heads_kv} heads but q has {heads}; the query heads must be a multiple of the K/V heads")
    cu_seqlens_q = features.get("cu_seqlens_q")
    batch = len(cu_seqlens_q) - 1 if packed and cu_seqlens_q is not None else int(q.shape[0])
    for name in arrays:
        descale = descales[f"{name}_descale"]
        shapes = [(batch, heads_kv)] + ([(batch, heads)] if name == "q" else [])
        if tuple(getattr(descale, "shape", ())) not in shapes:
            raise ValueError(f"{name}_descale has shape {tuple(getattr(descale, 'shape', ()))}; expected "
                             f"{' or '.join(str(shape) for shape in shapes)} (batch, heads)")
        kind = getattr(getattr(descale, "dtype", None), "kind", None)
        if kind != "f":
            raise TypeError(f"{name}_descale has dtype {getattr(descale, 'dtype', type(descale).__name__)}; expected float")
    _check_descale_values(descales, _xp(q) is not numpy and _capturing())
    return Fp8Call(batch, heads, heads_kv, packed)


_trusted = contextvars.ContextVar("cupy_flash_fp8_trusted_descales", default=False)


@contextlib.contextmanager
def trusted_descales():
    """Inside (this thread, this task), FP8 calls do not read GPU descales back to check them: no
    synchronisation a call, and a repeated call takes its short path with GPU descales too. Their
    values are then the caller's to keep finite and positive (a descale of inf or NaN gives outputs
    of inf or NaN, as such an input would in any precision). The adapters' own quantisation runs
    inside it."""
    token = _trusted.set(True)
    try:
        yield
    finally:
        _trusted.reset(token)


def descales_trusted() -> bool:
    """Whether the calls run inside trusted_descales."""
    return _trusted.get()


def _capturing() -> bool:
    """Whether CuPy's current stream is capturing a CUDA graph."""
    import cupy

    return cupy.cuda.get_current_stream().is_capturing()


def _check_descale_values(descales: dict, capturing: bool = False) -> None:
    """ValueError naming the first descale that holds a value not finite and positive. The GPU's are
    read back together: one synchronisation a call, not one per array and test. On a stream that
    is capturing a CUDA graph they are not read (a capture cannot synchronise; the graph reads
    them when replayed): host descales are refused there instead (a captured copy would read host
    memory when replayed)."""
    by_library: dict = {}
    for name, descale in descales.items():
        by_library.setdefault(_xp(descale), []).append(name)
    if capturing:
        if numpy in by_library:
            raise ValueError(f"{by_library[numpy][0]} is a host array, but the stream is capturing a CUDA graph: "
                             "descales must be GPU arrays there (a captured copy would read host memory when "
                             "replayed)")
        return
    if _trusted.get():   # inside trusted_descales: GPU descales not read back
        by_library = {xp: names for xp, names in by_library.items() if xp is numpy}
    for xp, names in by_library.items():
        # in float32, as the kernels read them (a float64 value past float32's range is refused)
        with numpy.errstate(over="ignore"):
            joined = xp.concatenate([xp.ravel(descales[name]) for name in names]).astype(xp.float32)
        if bool(xp.all(xp.isfinite(joined) & (joined > 0))):
            continue
        for name in names:
            with numpy.errstate(over="ignore"):
                descale = descales[name].astype(xp.float32)
            if not bool(xp.all(xp.isfinite(descale) & (descale > 0))):
                raise ValueError(f"{name} holds a value that is not finite and positive")

