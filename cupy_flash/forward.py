"""Forward launch: ``flash_forward`` / ``flash_attention``."""

from __future__ import annotations

from . import _checks, _traits
from ._compile import TENSOR_CORE_DTYPES, ModuleSpec, get_kernel, tensor_core_target
from ._params import as_argument, make_params
from ._streams import on_stream
from .decode import check_num_splits, launch_decode, uses_split_path


def launch_forward(q, k, v, shape, scale, variant):
    """Run the forward kernel on checked, kernel-ready arrays; returns (o, lse). float16 and
    bfloat16 run on tensor cores (mma.sync), float32 on the CUDA-core kernel. ``variant`` is a
    checked ``_features.Variant``: its flags select the kernel instantiation."""
    import cupy

    variant = variant.on_device()
    causal = variant.causal
    o = cupy.empty(q.shape, dtype=q.dtype)
    lse_shape = (shape.batch, shape.heads, shape.seqlen_q) if variant.packed is None else (shape.heads, variant.packed.total_q)
    lse = cupy.empty(lse_shape, dtype=cupy.float32)
    if shape.dtype in TENSOR_CORE_DTYPES:
        target = tensor_core_target()
        spec = ModuleSpec("forward_tc", shape.dtype, shape.tile, target, variant.flags)
        smem = _traits.forward_tc_smem_bytes(shape.tile, target, bias=variant.bias is not None)
        if smem > _traits.TARGET_SMEM_BYTES[target]:
            raise ValueError(f"bias with head_dim {shape.head_dim} needs {smem} bytes of shared memory per block; "
                             f"this GPU allows {_traits.TARGET_SMEM_BYTES[target]} (use head_dim <= 128, or an "
                             "sm_80/sm_90-class GPU)")
        kernel = get_kernel(spec, spec.forward_tc_kernel(causal), smem)
        block_m = _traits.forward_tc_block_m(shape.tile, target)
        threads = 32 * _traits.forward_tc_config(shape.tile, target)[1]   # 32 x num_warps
    else:
        spec = ModuleSpec("forward", shape.dtype, shape.tile, features=variant.flags)
        smem = _traits.forward_smem_bytes(shape.tile)
        kernel = get_kernel(spec, spec.forward_kernel(causal), smem)
        block_m, _ = _traits.FORWARD_BLOCKS[shape.tile]
        threads = _traits.THREADS
    grid = -(-shape.seqlen_q // block_m) * shape.batch * shape.heads
    params = make_params(shape, scale, variant=variant, q=q, k=k, v=v, o=o, lse=lse)
    kernel((grid,), (threads,), (as_argument(params),), shared_mem=smem)
    return o, lse


@on_stream
def flash_forward(q, k, v, *, softmax_scale=None, causal=False, num_splits=None, **features):
    """Exact attention ``softmax(softmax_scale * q k^T) v`` without materialising the scores.

    q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim) with
    heads_q a multiple of heads_kv (MQA/GQA); float16, bfloat16 (``ml_dtypes.bfloat16``) or
    float32, head_dim a multiple of 8 up to 256. CuPy arrays, or GPU arrays of other frameworks
    (taken through ``__cuda_array_interface__``/DLPack without a copy). Views whose rows are not
    contiguous and 16-byte aligned are copied once.

    ``causal=True`` masks key j for query i unless j <= i + seqlen_k - seqlen_q (bottom-right).
    Variants (any combination):
      ``window_size=(left, right)``: query i sees keys j with i + shift - left <= j <= i + shift + right
          (shift = seqlen_k - seqlen_q; -1 = unbounded; with causal, right is 0);
      ``softcap=c > 0``: logits become c * tanh(logit / c);
      ``alibi_slopes`` (heads_q,) or (batch, heads_q): logits get -slope * |i + shift - j|;
      ``sink`` (heads_q,): a logit per head that joins every row's softmax and carries no value;
      ``bias`` broadcastable to (batch, heads_q, seqlen_q, seqlen_k): added to the logits (after
          softcap and ALiBi); -inf masks. Read as float32 (another float dtype is converted once).
    Packed variable-length batches: ``cu_seqlens_q``, ``cu_seqlens_k`` (int32 (batch + 1,) prefix
    sums on the GPU; read back once to check them) with q (total_q, heads_q, head_dim) and k, v
    (total_k, heads_kv, head_dim); ``max_seqlen_q/k`` default to the longest sequence. Each sequence
    is attended on its own (causal and windows aligned to its own bottom-right corner); no padding
    is computed. Not combined with ``bias``.

    Split-KV: with float16/bfloat16, when each K/V head has few query rows (group x seqlen_q <= 32,
    e.g. decoding) the keys are split into ranges computed in parallel and merged exactly
    (``num_splits``: how many; default chosen from the SM count and the work; giving it takes this
    path whenever the variant allows: not with bias or packed batches).

    Returns ``(o, lse)``: o like q; lse float32 (batch, heads_q, seqlen_q) (packed: (heads_q,
    total_q)), the natural-log logsumexp of the logits (the sink included), -inf (with o = 0) for
    a row that sees no key.
    """
    _checks.check_no_extra_options("flash_forward", features)
    num_splits = check_num_splits(num_splits)
    q, k, v, shape, scale, variant = _checks.prepare_qkv(q, k, v, softmax_scale, causal, features)
    with q.device:
        _checks.same_device(q=q, k=k, v=v)
        q, k, v = (_checks.kernel_ready(x) for x in (q, k, v))
        if uses_split_path(shape, variant, num_splits):
            return launch_decode(q, k, v, shape, scale, variant, num_splits)
        return launch_forward(q, k, v, shape, scale, variant)


@on_stream
def flash_attention(q, k, v, **options):
    """``flash_forward(...)[0]``: the attention output only."""
    return flash_forward(q, k, v, **options)[0]
