"""Backward launch: ``flash_backward``."""

from __future__ import annotations

import ctypes
import dataclasses
import functools

import numpy

from . import _checks, _launch, _padding, _tma, backward_fp8, families
from ._features import broadcast_strides
from ._launch import (
    Packed,
    TileCounters,
    aligned_offsets,
    cached,
    cuda_calls,
    current_stream,
    kept,
    nbytes_of,
    packed_once,
    ready_stream,
    short_call_workspace,
)
from ._params import PointerRecord, make_params
from ._streams import STREAM_DOC, on_stream, record_kernel_arrays
from .families import rows
from .forward import _plan_key as forward_plan_key
from .forward_fp8 import is_fp8_call


def flash_backward(do, q, k, v, o, lse, *, softmax_scale=None, causal=False, deterministic=False,
                   return_dbias=False, stream=None, **features):
    """Gradients of ``o = flash_forward(q, k, v)[0]`` given the output gradient ``do``.

    ``o`` and ``lse`` are what ``flash_forward`` returned for the same q, k, v and options (do and
    o have v's head_dim); the scores are recomputed from ``lse``, so nothing O(seqlen^2) is stored
    or allocated.

    ``deterministic=False`` accumulates dQ with float32 atomics (fast; the summation order, and so
    the last bits, may vary run to run). ``deterministic=True`` sums dQ in a fixed order (float16
    and bfloat16: the key blocks add in turn, or a dQ kernel of its own sums each row's keys in
    registers; float32: a separate dQ pass): results are bitwise identical run to run. On Hopper,
    head_dim > 128 calls without a window or packed batches take the dQ kernel either way (it
    measured faster than the atomics there), so they are deterministic either way.

    The variant keywords (window_size, softcap, alibi_slopes, sink, bias, cu_seqlens_q/k,
    max_seqlen_q/k) must be those of the forward. With MQA/GQA, dk and dv sum the gradients of
    each K/V head's group of query heads.

    FP8 inputs (q, k, v as ``flash_forward`` took them: uint8 bits of e4m3 with ``q_descale``,
    ``k_descale``, ``v_descale``; do, o bfloat16) give the gradients of attention over the
    dequantised inputs, in bfloat16; the products run on bfloat16 tensor cores (docs/fp8.md).

    Returns ``(dq, dk, dv)`` with the shapes and dtype of q, k, v; with ``sink`` also dsink
    (float32, like sink); with ``return_dbias=True`` (and a bias) last dbias, the gradient of the
    bias in its own shape and dtype, summed over the axes it broadcasts over. Those sums are float32
    atomic adds, so ``deterministic=True`` with ``return_dbias`` needs a bias that broadcasts over
    no axis (every axis of size 1 is one of size 1 in (batch, heads_q, seqlen_q, seqlen_k) too).
    """
    # A repeated plain call on CuPy arrays takes its checked plan (_plans) and launches (as
    # flash_forward); a repeated FP8 one with host descales, its FP8 plan (backward_fp8).
    if stream is None and return_dbias is False:
        result = None
        key = _plan_key(do, q, k, v, o, lse, softmax_scale, causal, deterministic, features)
        if key is not None:
            plan = _plans.get(key)
            result = plan.call(do, q, k, v, o, lse) if plan is not None else None
        elif is_fp8_call(q, features):
            result = backward_fp8.repeated_call(do, q, k, v, o, lse, softmax_scale, causal, deterministic, features)
        if result is not None:
            return result
    return backward_into(None, do, q, k, v, o, lse, softmax_scale=softmax_scale, causal=causal,
                         deterministic=deterministic, return_dbias=return_dbias, stream=stream, **features)


flash_backward.__doc__ = flash_backward.__doc__.rstrip() + "\n" + STREAM_DOC


@on_stream
def backward_into(out, do, q, k, v, o, lse, *, softmax_scale=None, causal=False, deterministic=False,
                  return_dbias=False, **features):
    """flash_backward writing dq, dk, dv into ``out`` = (dq, dk, dv), C-contiguous GPU arrays like
    q, k, v on q's device (None: allocated): the adapters hand over their framework's buffers.
    dsink and dbias, where asked for, are allocated as in flash_backward."""
    keep_fp8_plan = None   # an FP8 call whose plan may be kept: keeps it with the bf16 plan it runs
    if is_fp8_call(q, features):   # the bfloat16 backward on the dequantised inputs (backward_fp8)
        fp8_key = backward_fp8.plan_key(do, q, k, v, o, lse, softmax_scale, causal, deterministic, features) \
            if return_dbias is False else None
        (q, k, v), features, dequantisation, in_place = backward_fp8.dequantized_call(
            do, q, k, v, o, lse, softmax_scale, causal, return_dbias, features)
        if fp8_key is not None and in_place:
            keep_fp8_plan = functools.partial(backward_fp8.keep_plan, fp8_key, dequantisation, heads=q.shape[-2])
    elif _padding.needs_padding(q, v):   # a head_dim that is not a multiple of 8: padded copies
        return _padding.backward(backward_into, out, do, q, k, v, o, lse, softmax_scale, causal, deterministic,
                                 return_dbias, features)
    key = _plan_key(do, q, k, v, o, lse, softmax_scale, causal, deterministic, features) \
        if return_dbias is False else None
    if key is not None:
        plan = _plans.get(key)
        if plan is not None and plan.device == plan.cuda.get_device():
            out = _check_gradient_outputs(out, q, k, v) if out is not None else None
            if keep_fp8_plan is not None:
                keep_fp8_plan(plan)
            return plan.run(dict(do=do, q=q, k=k, v=v, o=o, lse=lse), out)[0]
    _checks.check_no_extra_options("flash_backward", features, paged=False)
    given = (do, q, k, v, o, lse)
    q, k, v, shape, scale, variant = _checks.prepare_qkv(q, k, v, softmax_scale, causal, features)
    deterministic = _checks.check_flag("deterministic", deterministic)
    return_dbias = _checks.check_flag("return_dbias", return_dbias)
    if return_dbias and variant.bias is None:
        raise ValueError("return_dbias=True needs the bias the forward used (bias=...)")
    do, o, lse = (_checks.as_gpu_array(n, x) for n, x in (("do", do), ("o", o), ("lse", lse)))
    _checks.check_backward_extras(shape, q, do, o, lse, variant.packed)
    dbias_layout = _dbias_layout(variant.bias, shape) if return_dbias else None
    if dbias_layout is not None and deterministic and dbias_layout[1]:
        raise ValueError(f"deterministic=True with return_dbias=True needs a bias that is not summed over "
                         f"batch, heads or queries (its gradient would take atomic adds); bias has shape "
                         f"{tuple(variant.bias.shape)}")

    import cupy

    with q.device:
        _checks.same_device(q=q, k=k, v=v, do=do, o=o, lse=lse)
        q, k, v, do, o = (_checks.kernel_ready(x) for x in (q, k, v, do, o))
        lse = cupy.ascontiguousarray(lse)
        bias_dtype = None if variant.bias is None else variant.bias.dtype
        variant = variant.on_device()
        dq, dk, dv = _check_gradient_outputs(out, q, k, v)
        arrays = dict(do=do, q=q, k=k, v=v, o=o, lse=lse, dq=dq, dk=dk, dv=dv)
        plan = backward_plan(arrays, shape, scale, variant, deterministic, dbias_layout)
        if key is not None and all(x is y for x, y in zip((do, q, k, v, o, lse), given)):   # checked, no copy made
            kept(_plans, key, plan)
            if keep_fp8_plan is not None:
                keep_fp8_plan(plan)
        grads, temporaries = plan.run(dict(do=do, q=q, k=k, v=v, o=o, lse=lse), (dq, dk, dv))
        if variant.sink is not None:
            # The sink's probability in row i is exp(sink - lse_i) and its dP is 0 (it carries no
            # value), so d sink = -sum_i exp(sink - lse_i) * delta_i over batch and rows.
            delta = temporaries["delta"]
            if variant.packed is None:
                delta = delta.reshape(shape.batch, shape.heads, -1)[:, :, :shape.seqlen_q]   # drop the padding
                grads += (-(cupy.exp(variant.sink[None, :, None] - lse) * delta).sum(axis=(0, 2)),)
            else:   # lse (heads, total_q); delta (batch, heads, padded rows per sequence)
                rows = cupy.asarray(variant.packed.packed_row_of_padded(shape.seqlen_q))
                delta = delta.reshape(shape.batch, shape.heads, -1)[:, :, :shape.seqlen_q].transpose(1, 0, 2)
                delta = delta.reshape(shape.heads, -1)[:, rows]
                grads += (-(cupy.exp(variant.sink[:, None] - lse) * delta).sum(axis=1),)
        if dbias_layout is not None:
            grads += (temporaries["dbias"].reshape(variant.bias.shape).astype(bias_dtype, copy=False),)
        return grads


# Plans of plain calls (no feature keywords, no dbias) that passed the checks with every input
# readable as it is, by everything the checks and the plan read (forward._plan_key's fields for
# q, k, v, the same for do, o and lse, and deterministic with its type): a repeated call skips
# both. Measured on the H100's host: 240-470 us of Python a call before (checks, dispatch, params,
# a CuPy fill), against ~130 us for cuDNN's backward through PyTorch's autograd; at 512 keys the
# GPU waited for it (per-call 868 us against 692 us queued, d = 128).
_plans: dict = {}


def _plan_key(do, q, k, v, o, lse, softmax_scale, causal, deterministic, features=None):
    key = forward_plan_key(q, k, v, softmax_scale, causal, features)
    extras = _checks.backward_extras_key(type(q), do, o, lse, deterministic) if key is not None else None
    return None if extras is None else key + extras


def _check_gradient_outputs(out, q, k, v):
    """(dq, dk, dv): ``out``'s CuPy views, checked to be C-contiguous like q, k, v on their device
    (ValueError naming the one that is not), or new arrays."""
    import cupy

    if out is None:
        return tuple(cupy.empty(x.shape, dtype=x.dtype) for x in (q, k, v))
    return tuple(_checks.output_buffer(name, g, x.shape, x.dtype, x.data.device_id)
                 for name, g, x in zip(("dq", "dk", "dv"), out, (q, k, v)))


def _dbias_layout(bias, shape):
    """(shape, atomic) of the float32 dbias accumulator: the bias's shape padded to 4 dimensions;
    atomic when the bias broadcasts over any axis (several (b, h, i, j) then add into one element)."""
    full = (shape.batch, shape.heads, shape.seqlen_q, shape.seqlen_k)
    dims = (1,) * (4 - bias.ndim) + tuple(int(n) for n in bias.shape)
    return dims, any(n == 1 and want > 1 for n, want in zip(dims, full))


class BackwardPlan:
    """A backward call's launches with everything but the arrays' addresses: the temporaries (one
    workspace: each temporary's offset, shape, dtype and initial fill), the params records
    (PointerRecord: filled, addresses written per call), the kernels with their grids, and the
    layouts of the arrays the Hopper kernels' tensor maps read. Built once per checked call by
    backward_plan; plain calls keep theirs (_plans), so a training loop's repeated call is an
    allocation or four, memsets where a temporary starts at zero, and launches. It launches on
    addresses (``launch``), so the adapters run it on their framework's buffers."""

    def __init__(self, family: str, temporaries: tuple, records: dict, launches: tuple, held: tuple = (), maps=None,
                 tile_counter_bytes: int = 0, gradients: tuple = ()):
        self.cuda = cuda_calls()
        self.family = family
        self.records = records           # name -> PointerRecord
        self.held = held                 # the variant's device arrays the records point at
        self.maps = maps                 # Hopper: map sets, each ((array name, box rows), ...), dtype, packed, layouts
        self.device = self.cuda.get_device()
        early = _launch.supports_early(self.device)
        self.launches = tuple(launch._replace(early=launch.early and early) for launch in launches)   # _launch.Launch
        # The temporaries in one workspace, each at a 256-byte boundary: (name, offset, shape, dtype, fill)
        offsets, self.workspace_bytes = aligned_offsets(nbytes_of(shape, dtype) for _, shape, dtype, _ in temporaries)
        self.temporaries = tuple((name, offset, shape, numpy.dtype(dtype), fill)
                                 for (name, shape, dtype, fill), offset in zip(temporaries, offsets))
        self.zeroed = tuple((offset, nbytes_of(shape, dtype))
                            for _, offset, shape, dtype, fill in self.temporaries if fill == 0)
        # The names of a launch's addresses: the preprocess's (inputs and temporaries), then the rest's
        self.first_names = _INPUTS + tuple(name for name, *_ in self.temporaries)
        self.names = self.first_names + ("dq", "dk", "dv")
        self.gradients = gradients       # (shape, dtype) of dq, dk, dv: q's, k's, v's
        # dq, dk, dv in one allocation, each at a 256-byte boundary (as the forward's o and lse:
        # _launch.OutputAndLse): their offsets and its bytes
        self.gradient_offsets, self.gradients_bytes = aligned_offsets(nbytes_of(*g) for g in gradients)
        self._encoded: dict = {}         # the Hopper tensor maps by the arrays' addresses
        self._counters = TileCounters(tile_counter_bytes)  # the Hopper kernel's tile counters
        self._launched: dict = {}        # the main launches, packed (packed_once)
        self._launched_first: dict = {}  # the same for the preprocess (no gradients yet)

    def call(self, do, q, k, v, o, lse):
        """The repeated plain call (flash_backward's plan cache found this plan): (dq, dk, dv) in new
        arrays, or None where the plan cannot launch as it is (another current device, a stream
        capturing a graph: the general path keeps the temporaries alive)."""
        stream = ready_stream(self)
        if stream is None:
            return None
        inputs = (do.data.ptr, q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr, lse.data.ptr)
        workspace, _owner = self.workspace_on(stream)   # held until the launches are out
        first = self.launch_first(inputs, workspace, stream, False)
        gradients = self.outputs()
        self.launch_rest(first + tuple(g.data.ptr for g in gradients), stream, False)
        return gradients

    def workspace_on(self, stream: int, allocate=None) -> tuple:
        """A short call's workspace on the stream at ``stream`` (not capturing): (its address, what
        holds it, which the caller holds until its launches are out). Up to
        _launch.KEPT_WORKSPACE_BYTES the one kept for the stream; larger, ``allocate(bytes)``
        (CuPy's allocator by default), an object with ``ptr`` or ``data_ptr()``."""
        return short_call_workspace(self.workspace_bytes, self.device, stream, allocate or self.cuda.alloc)

    def outputs(self):
        """New (dq, dk, dv) from one allocation of CuPy's on the current stream (each holds it until
        all three are gone)."""
        cuda = self.cuda
        memory = cuda.alloc(self.gradients_bytes)
        empty = cuda.empty
        return tuple(empty(shape, dtype, memory + offset)
                     for (shape, dtype), offset in zip(self.gradients, self.gradient_offsets))

    def run(self, inputs: dict, out=None):
        """Launch on ``inputs`` (do, q, k, v, o, lse: kernel-ready, of the planned shapes, strides
        and device) into ``out`` = (dq, dk, dv) (checked views; None: allocated), on the current
        stream; returns ((dq, dk, dv), the temporaries by name (delta, dbias, ...): views of the
        call's workspace)."""
        import cupy

        stream, capturing = current_stream()
        workspace = cupy.cuda.alloc(self.workspace_bytes)
        first = self.launch_first(tuple(inputs[name].data.ptr for name in _INPUTS), workspace.ptr, stream, capturing)
        out = self.outputs() if out is None else out
        record_kernel_arrays(tuple(inputs.values()) + tuple(out) + (workspace,) + self.held)
        self.launch_rest(first + tuple(g.data.ptr for g in out), stream, capturing)
        temporaries = {name: cupy.ndarray(shape, dtype, workspace + offset)
                       for name, offset, shape, dtype, _ in self.temporaries}
        return out, temporaries

    def launch_first(self, inputs: tuple, workspace: int, stream: int, capturing: bool) -> tuple:
        """Zero the temporaries that start at zero and launch the preprocess, with do, q, k, v, o,
        lse at ``inputs`` and the temporaries in the workspace at ``workspace``; returns the
        addresses of first_names. The preprocess reads the inputs and writes temporaries only (its
        record's dq, dk, dv are null), so it goes out before the gradients are allocated: their
        allocations (~7 us of host time, which a short call's GPU waits for) move behind it."""
        addresses = inputs + tuple(workspace + offset for _, offset, *_ in self.temporaries)
        packed_once(self._launched_first, addresses, stream, capturing,
                    lambda: self._packed(self.launches[:1], dict(zip(self.first_names, addresses)), stream,
                                         capturing, tuple((workspace + offset, nbytes) for offset, nbytes in self.zeroed))).run()
        return addresses

    def launch_rest(self, addresses: tuple, stream: int, capturing: bool) -> None:
        """The launches after the preprocess, with the arrays of ``names`` at ``addresses``."""
        packed_once(self._launched, addresses, stream, capturing,
                    lambda: self._packed(self.launches[1:], dict(zip(self.names, addresses)), stream,
                                         capturing)).run()

    def _packed(self, launches: tuple, addresses: dict, stream: int, capturing: bool, zeroed: tuple = ()) -> Packed:
        """``launches`` (entries of self.launches) with their parameters for the arrays at
        ``addresses`` (by name), after ``zeroed`` ((address, bytes) set to zero)."""
        filled = {name: self.records[name].filled(addresses) for name in {launch.record for launch in launches}}
        packed = []
        for launch in launches:
            record = filled[launch.record]
            if launch.maps is None:
                arguments = (record,)
            elif launch.maps == 0:   # the main kernel, with its tile counter
                arguments = (self._maps_of(addresses, 0), record, ctypes.c_uint64(self._counters.address(stream, capturing)))
            else:   # the dQ kernel
                arguments = (self._maps_of(addresses, launch.maps), record)
            packed.append((launch.kernel, launch.grid, launch.threads, launch.smem, arguments, launch.early))
        return Packed(packed, stream, (self.family, tuple(launch.name for launch in launches)), zeroed)

    def _maps_of(self, addresses: dict, map_set: int):
        """A Hopper kernel's maps argument (BackwardSm90Maps, BackwardDqSm90Maps), encoded once per
        set of addresses (the layouts are the plan's)."""
        boxes, dtype, packed, layouts = self.maps[map_set]
        key = (map_set,) + tuple(addresses[name] for name, _ in boxes)
        encoded = cached(self._encoded, key, lambda: b"".join(
            _tma.attention_map_at(addresses[name], layouts[name], "float32" if name == "dq_accum" else dtype, rows, packed)
            for name, rows in boxes))
        return ctypes.create_string_buffer(encoded, _SM90_MAPS_BYTES)


_INPUTS = ("do", "q", "k", "v", "o", "lse")   # a backward launch's inputs, in the order of its addresses


# The arrays the kernels' params point at, by field (the names a plan's arrays go by: the same but
# dk and dv, which the main kernels write per query head under GQA and the group sum reads).
_MAIN_BINDINGS = dict(q="q", k="k", v="v", o="o", lse="lse", dout="do", delta="delta", lse_log2="lse_log2",
                      dq_accum="dq_accum", dq_semaphore="dq_semaphore", dq="dq", dk="dk_heads", dv="dv_heads",
                      dbias="dbias")


def backward_plan(arrays: dict, shape, scale, variant, deterministic: bool, dbias_layout) -> BackwardPlan:
    """The plan of a checked call: ``arrays`` its kernel-ready inputs and outputs by name (do, q,
    k, v, o, lse, dq, dk, dv), ``variant`` on the device, on the family families.backward_family
    picks. Around the family's launches: the preprocess (delta, lse in log2, the dQ accumulator
    zeroed), the scale-and-cast of the dQ accumulator where the family sums dQ in one
    (BackwardSchedule.dq_convert), and the GQA sum of per-query-head dK, dV."""
    import cupy

    q, k = arrays["q"], arrays["k"]
    bh = shape.batch * shape.heads
    device = families.current_device()
    family = families.backward_family(device, shape, variant, deterministic, (q, k, arrays["v"], arrays["do"]))
    schedule = family.backward_schedule(device, shape, variant, deterministic)
    # Row statistics (tensor cores): padded per (batch, head) to the schedule's multiple, padded rows
    # with delta 0 and lse_log2 +inf (P = 0, written by the preprocess), so a block's lse / delta
    # reads stay in its (batch, head)'s rows. A packed batch uses the same layout (its sequences
    # padded to the longest): O(batch x heads x max_seqlen_q) floats, read only where the
    # sequences are.
    row_stats = schedule.row_multiple is not None
    padded = -(-shape.seqlen_q // schedule.row_multiple) * schedule.row_multiple if row_stats else shape.seqlen_q
    expanded = k.shape[:-2] + (shape.heads,)   # MQA/GQA: per-query-head dK, dV, summed after
    temporaries = (
        ("delta", (bh, padded) if row_stats else (shape.batch, shape.heads, shape.seqlen_q), cupy.float32, None),
        ("lse_log2", (bh, padded), cupy.float32, None) if row_stats else None,
        ("dq_accum", q.shape, cupy.float32, None) if schedule.dq_accum else None,
        ("dq_semaphore", (bh * -(-shape.seqlen_q // schedule.block_m),), cupy.int32, 0) if schedule.dq_semaphores else None,
        # float32, so the group sum rounds once (kernels_cu/preprocess.cu)
        ("dk_heads", expanded + (shape.head_dim,), cupy.float32, None) if shape.group > 1 else None,
        ("dv_heads", expanded + (shape.head_dim_v,), cupy.float32, None) if shape.group > 1 else None,
        (("dbias", dbias_layout[0], cupy.float32, 0) if dbias_layout is not None else None),
    )
    temporaries = tuple(t for t in temporaries if t is not None)
    # The records are filled from stand-ins (no memory: make_params reads addresses and strides);
    # run() writes the addresses.
    stand_ins = {**arrays, **{name: cupy.ndarray(shape_, dtype=dtype, memptr=q.data) for name, shape_, dtype, _ in temporaries}}
    bindings = {field: name for field, name in _MAIN_BINDINGS.items() if name in stand_ins}
    if shape.group == 1:   # the main kernels write dk and dv themselves
        bindings.update(dk="dk", dv="dv")
    fields = {field: stand_ins[name] for field, name in bindings.items()}
    params = make_params(shape, scale, delta_stride=padded, variant=variant, **fields)
    if dbias_layout is not None:
        params["dbias_strides"] = broadcast_strides(stand_ins["dbias"])   # contiguous, stride 0 where the bias broadcasts
        params["dbias_atomic"] = int(dbias_layout[1])
    records = {"main": PointerRecord(params, bindings)}
    row_shape = shape
    if variant.packed is not None:   # the row kernels see a packed batch as one sequence of all its rows
        row_shape = dataclasses.replace(shape, batch=1, seqlen_q=variant.packed.total_q, seqlen_k=variant.packed.total_k)
        # ... with cu_seqlens_q, so the preprocess writes delta (and lse_log2) into the main kernels'
        # per-sequence layout
        row = make_params(row_shape, scale, delta_stride=padded, cu_seqlens_q=variant.packed.cu_seqlens_q, **fields)
        row["packed_sequences"] = shape.batch
        records["row"] = PointerRecord(row, bindings)
    row_record = "row" if "row" in records else "main"

    launches = [rows.row_launch(rows.PREPROCESS, row_shape, record=row_record)]
    main, maps, counter_bytes = family.backward_launches(schedule, device, shape, variant, deterministic, stand_ins)
    launches += main
    if schedule.dq_convert:
        launches.append(rows.row_launch(rows.DQ_CONVERT, row_shape, record=row_record))
    if shape.group > 1:
        records["group"] = PointerRecord(
            make_params(row_shape, scale, dk=arrays["dk"], dv=arrays["dv"], dk_expanded=stand_ins["dk_heads"],
                        dv_expanded=stand_ins["dv_heads"]),
            dict(dk="dk", dv="dv", dk_expanded="dk_heads", dv_expanded="dv_heads"))
        launches.append(rows.row_launch(rows.KV_GROUP_SUM, row_shape, record="group",
                                        rows=row_shape.batch * row_shape.seqlen_k * row_shape.heads_kv))
    held = tuple(x for x in variant.device_arrays() if x is not None)
    gradients = tuple((tuple(arrays[name].shape), arrays[name].dtype) for name in ("q", "k", "v"))
    return BackwardPlan(family.name, temporaries, records, tuple(launches), held, maps, counter_bytes, gradients)


_SM90_MAPS_BYTES = 5 * _tma.MAP_BYTES   # kernels_cu/backward_sm90.cu: BackwardSm90Maps (tests/test_compile.py holds them equal)
