"""Backward launch: ``flash_backward``."""

from __future__ import annotations

import dataclasses

import numpy

from . import _checks, _families, _tma, _traits
from ._compile import TENSOR_CORE_DTYPES, ModuleSpec, device_value, get_kernel
from ._families import current_device
from ._features import broadcast_strides
from ._params import as_argument, make_params
from ._streams import on_stream
from .preprocess import launch_dq_convert, launch_kv_group_sum, launch_preprocess


@on_stream
def flash_backward(do, q, k, v, o, lse, *, softmax_scale=None, causal=False, deterministic=False,
                   return_dbias=False, **features):
    """Gradients of ``o = flash_forward(q, k, v)[0]`` given the output gradient ``do``.

    ``o`` and ``lse`` are what ``flash_forward`` returned for the same q, k, v and options; the
    scores are recomputed from ``lse``, so nothing O(seqlen^2) is stored or allocated.

    ``deterministic=False`` accumulates dQ with float32 atomics (fast; the summation order, and so
    the last bits, may vary run to run). ``deterministic=True`` sums dQ in a fixed order (float16
    and bfloat16: the key blocks add in turn; float32: a separate dQ pass): results are bitwise
    identical run to run.

    The variant keywords (window_size, softcap, alibi_slopes, sink, bias, cu_seqlens_q/k,
    max_seqlen_q/k) must be those of the forward. With MQA/GQA, dk and dv sum the gradients of
    each K/V head's group of query heads.

    Returns ``(dq, dk, dv)`` with the shapes and dtype of q, k, v; with ``sink`` also dsink
    (float32, like sink); with ``return_dbias=True`` (and a bias) last dbias, the gradient of the
    bias in its own shape and dtype, summed over the axes it broadcasts over. Those sums are float32
    atomic adds, so ``deterministic=True`` with ``return_dbias`` needs a bias that broadcasts over
    no axis (every axis of size 1 is one of size 1 in (batch, heads_q, seqlen_q, seqlen_k) too).
    """
    return backward_into(None, do, q, k, v, o, lse, softmax_scale=softmax_scale, causal=causal,
                         deterministic=deterministic, return_dbias=return_dbias, **features)


@on_stream
def backward_into(out, do, q, k, v, o, lse, *, softmax_scale=None, causal=False, deterministic=False,
                  return_dbias=False, **features):
    """flash_backward writing dq, dk, dv into ``out`` = (dq, dk, dv), C-contiguous GPU arrays like
    q, k, v on q's device (None: allocated): the adapters hand over their framework's buffers.
    dsink and dbias, where asked for, are allocated as in flash_backward."""
    _checks.check_no_extra_options("flash_backward", features)
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
        # MQA/GQA: the kernels write per-query-head dK/dV, summed over each group afterwards.
        expanded = k.shape[:-2] + (shape.heads, shape.head_dim)
        dk_heads, dv_heads = (dk, dv) if shape.group == 1 else (cupy.empty(expanded, k.dtype), cupy.empty(expanded, v.dtype))
        dbias = None if dbias_layout is None else cupy.zeros(dbias_layout[0], dtype=cupy.float32)
        backward = _backward_tensor_core if shape.dtype in TENSOR_CORE_DTYPES else _backward_cuda_core
        delta = backward(do, q, k, v, o, lse, dq, dk_heads, dv_heads, shape, scale, variant, deterministic,
                         dbias, dbias_layout)
        if shape.group > 1:
            row_shape = _row_shape(shape, variant)
            launch_kv_group_sum(make_params(row_shape, scale, dk=dk, dv=dv, dk_expanded=dk_heads, dv_expanded=dv_heads),
                                row_shape)
        grads = (dq, dk, dv)
        if variant.sink is not None:
            # The sink's probability in row i is exp(sink - lse_i) and its dP is 0 (it carries no
            # value), so d sink = -sum_i exp(sink - lse_i) * delta_i over batch and rows.
            if variant.packed is None:
                delta = delta.reshape(shape.batch, shape.heads, -1)[:, :, :shape.seqlen_q]   # drop the padding
                grads += (-(cupy.exp(variant.sink[None, :, None] - lse) * delta).sum(axis=(0, 2)),)
            else:   # lse (heads, total_q); delta (batch, heads, padded rows per sequence)
                rows = cupy.asarray(variant.packed.packed_row_of_padded(shape.seqlen_q))
                delta = delta.reshape(shape.batch, shape.heads, -1)[:, :, :shape.seqlen_q].transpose(1, 0, 2)
                delta = delta.reshape(shape.heads, -1)[:, rows]
                grads += (-(cupy.exp(variant.sink[:, None] - lse) * delta).sum(axis=1),)
        if dbias is not None:
            grads += (dbias.reshape(variant.bias.shape).astype(bias_dtype, copy=False),)
        return grads


def _check_gradient_outputs(out, q, k, v):
    """(dq, dk, dv): ``out``'s CuPy views, checked to be C-contiguous like q, k, v on their device
    (ValueError naming the one that is not), or new arrays."""
    import cupy

    if out is None:
        return tuple(cupy.empty(x.shape, dtype=x.dtype) for x in (q, k, v))
    return tuple(_checks.output_buffer(name, g, x.shape, x.dtype, x.data.device_id)
                 for name, g, x in zip(("dq", "dk", "dv"), out, (q, k, v)))


def _row_shape(shape, variant):
    """The row kernels see a packed batch as one sequence of all its rows."""
    if variant.packed is None:
        return shape
    return dataclasses.replace(shape, batch=1, seqlen_q=variant.packed.total_q, seqlen_k=variant.packed.total_k)


def _packed_row_params(row_shape, shape, scale, delta_stride, variant, arrays):
    """Row-kernel params of a packed batch: all rows as one sequence, with cu_seqlens_q so the
    preprocess kernel writes delta (and lse_log2) into the attention kernels' per-sequence layout."""
    record = make_params(row_shape, scale, delta_stride=delta_stride, cu_seqlens_q=variant.packed.cu_seqlens_q, **arrays)
    record["packed_sequences"] = shape.batch
    return record


def _dbias_layout(bias, shape):
    """(shape, atomic) of the float32 dbias accumulator: the bias's shape padded to 4 dimensions;
    atomic when the bias broadcasts over any axis (several (b, h, i, j) then add into one element)."""
    full = (shape.batch, shape.heads, shape.seqlen_q, shape.seqlen_k)
    dims = (1,) * (4 - bias.ndim) + tuple(int(n) for n in bias.shape)
    return dims, any(n == 1 and want > 1 for n, want in zip(dims, full))


def _fill_dbias(params, dbias, dbias_layout):
    if dbias is None:
        return
    params["dbias"] = dbias.data.ptr
    params["dbias_strides"] = broadcast_strides(dbias)   # contiguous, stride 0 where the bias broadcasts
    params["dbias_atomic"] = int(dbias_layout[1])


def _backward_tensor_core(do, q, k, v, o, lse, dq, dk, dv, shape, scale, variant, deterministic, dbias, dbias_layout):
    """float16 / bfloat16: backward_tc.cu. dQ is accumulated in float32 (atomically, or in a fixed
    order when deterministic) and then scaled and cast by the convert kernel. Returns delta as
    (batch * heads, padded seqlen_q)."""
    import cupy

    target = current_device().tensor_core_target
    hopper = _families.backward_family(current_device(), shape, variant, deterministic, (q, k, v, do)) == "backward_sm90"
    block_m, block_n, num_warps, *_ = _traits.backward_tc_config(shape.tile, target)
    if hopper:   # the semaphores count the Hopper kernel's query blocks
        _, _, block_m, _ = _traits.backward_sm90_config(_traits.forward_sm90_tile(shape.head_dim))
    bh = shape.batch * shape.heads
    padded = -(-shape.seqlen_q // _traits.ROW_STAT_PADDING) * _traits.ROW_STAT_PADDING
    # Row statistics padded per (batch, head): padded rows have delta 0 and lse_log2 +inf (P = 0).
    # A packed batch uses the same layout (its sequences padded to the longest): O(batch x heads x
    # max_seqlen_q) floats, read only where the sequences are.
    delta = cupy.zeros((bh, padded), dtype=cupy.float32)
    lse_log2 = cupy.full((bh, padded), numpy.inf, dtype=cupy.float32)
    dq_accum = cupy.empty(q.shape, dtype=cupy.float32)   # zeroed by the preprocess kernel
    num_q_blocks = -(-shape.seqlen_q // block_m)
    dq_semaphore = cupy.zeros(bh * num_q_blocks, dtype=cupy.int32) if deterministic else None

    arrays = dict(q=q, k=k, v=v, o=o, lse=lse, dout=do, delta=delta, lse_log2=lse_log2, dq_accum=dq_accum,
                  dq_semaphore=dq_semaphore, dq=dq, dk=dk, dv=dv)
    params = make_params(shape, scale, delta_stride=padded, variant=variant, **arrays)
    _fill_dbias(params, dbias, dbias_layout)
    row_shape = _row_shape(shape, variant)
    row_params = params if row_shape is shape else _packed_row_params(row_shape, shape, scale, padded, variant, arrays)
    launch_preprocess(row_params, row_shape)

    if hopper:
        _launch_backward_sm90(q, k, v, do, dq_accum, shape, variant, params)
    else:
        spec = ModuleSpec("backward_tc", shape.dtype, shape.tile, target, variant.backward_flags)
        smem = _traits.backward_tc_smem_bytes(shape.tile, target)
        kernel = get_kernel(spec, spec.backward_tc_kernel(variant.causal), smem)
        kernel((-(-shape.seqlen_k // block_n) * bh,), (32 * num_warps,), (as_argument(params),), shared_mem=smem)
    launch_dq_convert(row_params, row_shape)
    return delta


_sm90_maps: dict = {}   # the Hopper backward's q, k, v, dO and dq_accum tensor maps, by everything that enters them
_SM90_MAPS_BYTES = 5 * _tma.MAP_BYTES   # kernels_cu/backward_sm90.cu: BackwardSm90Maps (tests/test_compile.py holds them equal)


def _launch_backward_sm90(q, k, v, do, dq_accum, shape, variant, params) -> None:
    """The Hopper backward's main kernel (kernels_cu/backward_sm90.cu) on a filled params record
    (the preprocess has run; the dQ convert runs after). Where it runs: _families.backward_family."""
    spec = ModuleSpec("backward_sm90", shape.dtype, _traits.forward_sm90_tile(shape.head_dim), "sm90a",
                      variant.backward_flags)
    _, block_n, block_m, _ = spec.config
    smem = device_value(spec, spec.backward_sm90_smem())
    kernel = get_kernel(spec, spec.backward_sm90_kernel(variant.causal), smem)
    packed = variant.packed is not None
    arrays = ((q, block_m), (k, block_n), (v, block_n), (do, block_m),
              (dq_accum, _traits.BACKWARD_SM90_DQ_ROWS[spec.tile]))   # BackwardSm90Maps
    key = tuple((x.data.ptr, x.shape, x.strides, rows) for x, rows in arrays) + (shape.dtype, packed)
    encoded = _tma.cached(_sm90_maps, key, lambda: b"".join(
        _tma.attention_map(x, "float32" if x is dq_accum else shape.dtype, rows, packed) for x, rows in arrays))
    maps = numpy.frombuffer(encoded, dtype=numpy.dtype((numpy.void, _SM90_MAPS_BYTES)))
    grid = -(-shape.seqlen_k // block_n) * shape.batch * shape.heads
    kernel((grid,), (_traits.backward_sm90_threads(spec.config),), (maps, as_argument(params)), shared_mem=smem)


def _backward_cuda_core(do, q, k, v, o, lse, dq, dk, dv, shape, scale, variant, deterministic, dbias, dbias_layout):
    """float32: backward.cu. dQ with float32 atomics, or when deterministic by a separate pass.
    Returns delta."""
    import cupy

    causal = variant.causal
    # float32 dQ accumulator for the atomic path: O(batch * seqlen * heads * head_dim).
    dq_accum = None if deterministic else cupy.empty(q.shape, dtype=cupy.float32)
    row_shape = _row_shape(shape, variant)
    # (batch, heads, seqlen_q); packed: sequences padded to the longest, rows past one unread.
    delta = cupy.empty((shape.batch, shape.heads, shape.seqlen_q), dtype=cupy.float32)
    arrays = dict(q=q, k=k, v=v, dout=do, o=o, lse=lse, delta=delta, dq_accum=dq_accum, dq=dq, dk=dk, dv=dv)
    params = make_params(shape, scale, variant=variant, **arrays)
    _fill_dbias(params, dbias, dbias_layout)
    row_params = params if row_shape is shape else _packed_row_params(row_shape, shape, scale, shape.seqlen_q, variant, arrays)
    launch_preprocess(row_params, row_shape)

    spec = ModuleSpec("backward", shape.dtype, shape.tile, features=variant.backward_flags)
    block_m, block_n = _traits.BACKWARD_BLOCKS[shape.tile]
    bh = shape.batch * shape.heads
    smem = _traits.backward_smem_bytes(shape.tile)
    kernel = get_kernel(spec, spec.backward_kernel(causal, atomic_dq=not deterministic), smem)
    kernel((-(-shape.seqlen_k // block_n) * bh,), (_traits.THREADS,), (as_argument(params),), shared_mem=smem)
    if deterministic:
        smem = _traits.backward_dq_smem_bytes(shape.tile)
        kernel = get_kernel(spec, spec.backward_dq_kernel(causal), smem)
        kernel((-(-shape.seqlen_q // block_m) * bh,), (_traits.THREADS,), (as_argument(params),), shared_mem=smem)
    else:
        launch_dq_convert(row_params, row_shape)
    return delta
