"""The FP8 backward's launch code: ``flash_backward`` on e4m3 q, k, v (uint8 bits with their
descales, as ``flash_forward`` took them; docs/fp8.md, "The backward").

The gradients are those of attention over the dequantised inputs (q x q_descale, ...), in
bfloat16: the straight-through gradients a model that quantises its q, k, v wants. The products
run on bfloat16 tensor cores: fp8_dequantize_kernel (kernels_cu/preprocess.cu) writes q, k, v
times their descales in bfloat16, and the bfloat16 backward runs on them with the FP8 forward's o
and lse. Every check runs before the first launch. A repeated call with host descales takes
Fp8BackwardPlan's short path (the forward's DescaleRing, the Dequantisation's packed launches, the
bf16 plan's own short path)."""

from __future__ import annotations

import ctypes

import numpy

from . import _checks
from ._dtypes import bfloat16
from ._launch import Packed, cuda_calls, current_stream, kept, packed_once, ready_stream
from ._streams import record_kernel_arrays
from .families import rows
from .forward_fp8 import DESCALES, popped_descales, short_path_descales, upload_descales
from .forward_fp8 import _plan_key as fp8_plan_key
from .fp8 import check_fp8_call

# fp8_dequantize_kernel's parameters (tests/test_compile.py holds them equal): x, its batch, row and
# head strides (bytes), batch, rows, heads, head_dim, descale, descale_heads, cu_seqlens, sequences, out.
DEQUANTIZE_PARAMETERS = (ctypes.c_uint64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32,
                         ctypes.c_int32, ctypes.c_int32, ctypes.c_uint64, ctypes.c_int32, ctypes.c_uint64, ctypes.c_int32,
                         ctypes.c_uint64)


def dequantized_call(do, q, k, v, o, lse, softmax_scale, causal, return_dbias, features: dict) -> tuple:
    """flash_backward's FP8 call as a bfloat16 one: (q, k, v dequantised in bfloat16, the features
    without the descales, the Dequantisation, whether q, k, v were read in place). TypeError /
    ValueError naming the argument, before any launch, for what the FP8 forward refuses and for do,
    o, lse unlike its outputs (do and o bfloat16)."""
    features = dict(features)
    descales = popped_descales(features)
    _checks.check_no_extra_options("flash_backward", features, paged=False)
    q, k, v = (_checks.as_gpu_array(name, x) for name, x in (("q", q), ("k", k), ("v", v)))
    check_fp8_call("flash_backward", dict(q=q, k=k, v=v), descales, features)
    if _checks.check_flag("return_dbias", return_dbias):
        raise ValueError("return_dbias=True is not supported with FP8 inputs (they take no bias)")
    given = (q, k, v)
    q, k, v, shape, _, variant = _checks.prepare_qkv(q, k, v, softmax_scale, causal, features, fp8=True)
    do, o, lse = (_checks.as_gpu_array(n, x) for n, x in (("do", do), ("o", o), ("lse", lse)))
    _checks.check_backward_extras(shape, q, do, o, lse, variant.packed, fp8=True)
    with q.device:
        _checks.same_device(q=q, k=k, v=v, do=do, o=o, lse=lse,
                            **{name: x for name, x in descales.items() if not isinstance(x, numpy.ndarray)})
        q, k, v = (_checks.kernel_ready(x) for x in (q, k, v))
        dequantisation = Dequantisation(q, k, v, shape, variant.packed)
        stream, capturing = current_stream()
        uploaded = upload_descales(descales, shape.heads, stream, capturing)
        dequantised = dequantisation.outputs()
        record_kernel_arrays((q, k, v) + uploaded.held + dequantised + dequantisation.held)
        dequantisation.launch((q, k, v), uploaded.addresses, dequantised, stream, capturing)
        uploaded.launched(stream)
    in_place = all(x is y for x, y in zip((q, k, v), given))
    return dequantised, features, dequantisation, in_place


class Dequantisation:
    """fp8_dequantize_kernel's launches for a checked call's kernel-ready q, k, v (e4m3 bits) into
    new contiguous bfloat16 arrays, everything but the addresses fixed, packed once per set of
    addresses (packed_once)."""

    def __init__(self, q, k, v, shape, packed):
        self.cuda = cuda_calls()
        self.shapes = tuple(tuple(x.shape) for x in (q, k, v))
        self.held = () if packed is None else (packed.cu_seqlens_q, packed.cu_seqlens_k)
        cu_seqlens = (None,) * 3 if packed is None else (packed.cu_seqlens_q, packed.cu_seqlens_k, packed.cu_seqlens_k)
        self.fixed = []   # per tensor: (its strides and sizes, the cu_seqlens part, its Launch)
        for x, cu in zip((q, k, v), cu_seqlens):
            if cu is None:
                batch, row_count, heads, head_dim = x.shape
                strides, sequence_part = x.strides[:3], (0, 0)
            else:
                (row_count, heads, head_dim), batch = x.shape, 1
                strides, sequence_part = (0, *x.strides[:2]), (cu.data.ptr, shape.batch)
            launch = rows.dequantize_launch("bfloat16", batch * row_count * heads * (head_dim // 16))
            # descale_heads = heads: the descales come per head of x (upload_descales')
            self.fixed.append(((*strides, batch, row_count, heads, head_dim), heads, sequence_part, launch))
        self._launches: dict = {}

    def outputs(self) -> tuple:
        return tuple(self.cuda.empty(shape, bfloat16()) for shape in self.shapes)

    def launch(self, inputs: tuple, descale_addresses: tuple, outputs: tuple, stream: int, capturing: bool) -> None:
        """Dequantise the e4m3 ``inputs`` (q, k, v) with their descales at ``descale_addresses`` into
        ``outputs`` (the arrays of outputs()) on the stream at ``stream``."""
        addresses = tuple(x.data.ptr for x in inputs + outputs) + descale_addresses
        packed_once(self._launches, addresses, stream, capturing, lambda: self._packed(addresses, stream)).run()

    def _packed(self, addresses: tuple, stream: int) -> Packed:
        launches = []
        for i, (sizes, descale_heads, sequence_part, launch) in enumerate(self.fixed):
            values = (addresses[i], *sizes, addresses[6 + i], descale_heads, *sequence_part, addresses[3 + i])
            arguments = tuple(kind(value) for kind, value in zip(DEQUANTIZE_PARAMETERS, values))
            launches.append((launch.kernel, launch.grid, launch.threads, 0, arguments, False))
        return Packed(tuple(launches), stream, ("rows", tuple(fixed[-1].name for fixed in self.fixed)))


class Fp8BackwardPlan:
    """A repeated FP8 backward call's short path: the Dequantisation, then the bfloat16 backward's
    plan (backward.BackwardPlan) on the dequantised arrays."""

    def __init__(self, dequantisation: Dequantisation, backward_plan, heads: int):
        self.dequantisation, self.backward_plan, self.heads = dequantisation, backward_plan, heads

    def call(self, do, q, k, v, o, lse, descales: dict):
        """(dq, dk, dv) of a call that repeats the checked one this plan was made from, with
        descales the short path takes (forward_fp8.short_path_descales); or None where the checked
        route must take it (GPU descales outside trusted_descales, whose read-back it makes; a
        descale value to refuse, which it names; another current device; a capturing stream)."""
        stream = ready_stream(self.backward_plan)
        if stream is None:
            return None
        uploaded = short_path_descales(descales, self.heads, stream)
        if uploaded is None:
            return None
        dequantised = self.dequantisation.outputs()
        self.dequantisation.launch((q, k, v), uploaded.addresses, dequantised, stream, False)
        uploaded.launched(stream)
        return self.backward_plan.call(do, *dequantised, o, lse)


def plan_key(do, q, k, v, o, lse, softmax_scale, causal, deterministic, features: dict):
    """The FP8 plan cache's key of a call on CuPy arrays with no keywords but the descales, or None."""
    if any(name not in DESCALES for name in features):
        return None
    key = fp8_plan_key(q, k, v, softmax_scale, causal, {name: features.get(name) for name in DESCALES})
    extras = _checks.backward_extras_key(type(q), do, o, lse, deterministic) if key is not None else None
    return None if extras is None else key + extras


def repeated_call(do, q, k, v, o, lse, softmax_scale, causal, deterministic, features: dict):
    """flash_backward's short path for an FP8 call that repeats a checked one: its gradients, or None."""
    key = plan_key(do, q, k, v, o, lse, softmax_scale, causal, deterministic, features)
    plan = _plans.get(key) if key is not None else None
    return None if plan is None else plan.call(do, q, k, v, o, lse, features)


def keep_plan(key, dequantisation: Dequantisation, backward_plan, *, heads: int) -> None:
    """Keep the FP8 plan of a checked call (``key``: plan_key's) with the bf16 plan it ran."""
    kept(_plans, key, Fp8BackwardPlan(dequantisation, backward_plan, heads))


# Plans of FP8 calls without variant keywords whose q, k, v were read in place, by plan_key.
_plans: dict = {}
