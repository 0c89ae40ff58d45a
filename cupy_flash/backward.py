"""Backward launch: ``flash_backward``."""

from __future__ import annotations

from . import _checks, _traits
from ._compile import ModuleSpec, get_kernel
from ._params import make_params
from .preprocess import launch_preprocess, row_kernel_grid


def flash_backward(do, q, k, v, o, lse, *, softmax_scale=None, causal=False, deterministic=False, **features):
    """Gradients of ``o = flash_forward(q, k, v)[0]`` given the output gradient ``do``.

    ``o`` and ``lse`` are what ``flash_forward`` returned for the same q, k, v and options; the
    scores are recomputed from ``lse``, so nothing O(seqlen^2) is stored or allocated.

    ``deterministic=False`` accumulates dQ with float32 atomics (fast; the summation order, and so
    the last bits, may vary run to run). ``deterministic=True`` computes dQ in a separate pass
    with a fixed order: results are bitwise identical run to run.

    Returns ``(dq, dk, dv)`` with the shapes and dtype of q, k, v.
    """
    _checks.check_no_extra_options("flash_backward", features)
    q, k, v, shape, scale, causal = _checks.prepare_qkv(q, k, v, softmax_scale, causal)
    deterministic = _checks.check_flag("deterministic", deterministic)
    do, o, lse = (_checks.as_gpu_array(n, x) for n, x in (("do", do), ("o", o), ("lse", lse)))
    _checks.check_backward_extras(shape, q, do, o, lse)

    import cupy

    with q.device:
        _checks.same_device(q=q, k=k, v=v, do=do, o=o, lse=lse)
        q, k, v, do, o = (_checks.kernel_ready(x) for x in (q, k, v, do, o))
        lse = cupy.ascontiguousarray(lse)

        dq = cupy.empty(q.shape, dtype=q.dtype)
        dk = cupy.empty(k.shape, dtype=k.dtype)
        dv = cupy.empty(v.shape, dtype=v.dtype)
        # float32 dQ accumulator for the atomic path: O(batch * seqlen * heads * head_dim).
        dq_accum = None if deterministic else cupy.empty(q.shape, dtype=cupy.float32)
        delta = launch_preprocess(do, o, shape, dq_accum=dq_accum)

        spec = ModuleSpec("backward", shape.dtype, shape.tile)
        block_m, block_n = _traits.BACKWARD_BLOCKS[shape.tile]
        params = make_params(shape, scale, q=q, k=k, v=v, dout=do, lse=lse, delta=delta,
                             dq_accum=dq_accum, dq=dq, dk=dk, dv=dv)
        bh = shape.batch * shape.heads

        smem = _traits.backward_smem_bytes(shape.tile)
        kernel = get_kernel(spec, spec.backward_kernel(causal, atomic_dq=not deterministic), smem)
        kernel((-(-shape.seqlen_k // block_n) * bh,), (_traits.THREADS,), (params,), shared_mem=smem)

        if deterministic:
            smem = _traits.backward_dq_smem_bytes(shape.tile)
            kernel = get_kernel(spec, spec.backward_dq_kernel(causal), smem)
            kernel((-(-shape.seqlen_q // block_m) * bh,), (_traits.THREADS,), (params,), shared_mem=smem)
        else:
            kernel = get_kernel(spec, spec.dq_convert_kernel())
            kernel((row_kernel_grid(shape),), (_traits.ROW_KERNEL_THREADS,), (params,))
        return dq, dk, dv
