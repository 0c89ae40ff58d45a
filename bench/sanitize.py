"""Small forward + backward (atomic and deterministic) for every dtype, causal and not, on ragged
shapes: the workload compute-sanitizer's memcheck and racecheck run over."""

# ruff: noqa: E402 - the imports follow the help guard, which must run first

from bench import help_first

help_first("sanitize", __doc__)

import cupy
import ml_dtypes
import numpy

import cupy_flash
from cupy_flash import families

rng = numpy.random.default_rng(0)
for dtype in (numpy.float16, ml_dtypes.bfloat16, numpy.float32):
    for causal in (False, True):
        # (v's head_dim apart from q's: FEATURE_HEAD_DIM_V; above 256: the wide tiles, v's columns
        # over two blocks)
        for (nq, nk, d, d_v) in ((70, 45, 72, 72), (33, 130, 256, 256), (129, 129, 32, 32), (70, 45, 40, 104),
                                 (40, 33, 512, 512), (33, 50, 264, 448)):
            q = cupy.asarray(rng.standard_normal((1, nq, 2, d), dtype=numpy.float32).astype(dtype))
            k = cupy.asarray(rng.standard_normal((1, nk, 2, d), dtype=numpy.float32).astype(dtype))
            v = cupy.asarray(rng.standard_normal((1, nk, 2, d_v), dtype=numpy.float32).astype(dtype))
            o, lse = cupy_flash.flash_forward(q, k, v, causal=causal)
            for deterministic in (False, True):
                cupy_flash.flash_backward(o, q, k, v, o, lse, causal=causal, deterministic=deterministic)
    # Repeated plain calls on new arrays: the later ones take the kept plans (the short paths of
    # flash_forward and flash_backward: launches on new addresses, the backward's workspace).
    for _ in range(3):
        q, k, v = (cupy.asarray(rng.standard_normal((2, 70, 2, 72), dtype=numpy.float32).astype(dtype)) for _ in range(3))
        o, lse = cupy_flash.flash_forward(q, k, v, causal=True)
        cupy_flash.flash_backward(o, q, k, v, o, lse, causal=True)
    # Variants: a broadcast bias with dbias (atomic adds) and a full one (plain stores), and a
    # packed batch with an empty sequence, GQA and a window.
    q = cupy.asarray(rng.standard_normal((2, 70, 2, 64), dtype=numpy.float32).astype(dtype))
    k = cupy.asarray(rng.standard_normal((2, 45, 2, 64), dtype=numpy.float32).astype(dtype))
    for bias_shape in ((2, 1, 1, 45), (2, 2, 70, 45)):
        bias = cupy.asarray(rng.standard_normal(bias_shape, dtype=numpy.float32))
        o, lse = cupy_flash.flash_forward(q, k, k, causal=True, bias=bias)
        cupy_flash.flash_backward(o, q, k, k, o, lse, causal=True, bias=bias, return_dbias=True)
    lens_q, lens_k = [70, 0, 33], [45, 9, 130]
    q = cupy.asarray(rng.standard_normal((sum(lens_q), 4, 64), dtype=numpy.float32).astype(dtype))
    k = cupy.asarray(rng.standard_normal((sum(lens_k), 2, 64), dtype=numpy.float32).astype(dtype))
    packed = dict(cu_seqlens_q=cupy.asarray(numpy.cumsum([0] + lens_q), dtype=cupy.int32),
                  cu_seqlens_k=cupy.asarray(numpy.cumsum([0] + lens_k), dtype=cupy.int32), window_size=(20, -1))
    o, lse = cupy_flash.flash_forward(q, k, k, causal=True, **packed)
    for deterministic in (False, True):
        cupy_flash.flash_backward(o, q, k, k, o, lse, causal=True, deterministic=deterministic, **packed)
    if dtype == numpy.float32:
        continue
    # Decoding: contiguous and paged caches (pages of 16, shuffled), one and several splits, an
    # append, GQA, a window; the split path of flash_forward; merge_attention_states.
    for paged in (False, True):
        for splits in (1, 4):
            batch, capacity, heads_kv, d = 2, 96, 2, 72
            q = cupy.asarray(rng.standard_normal((batch, 3, 8, d), dtype=numpy.float32).astype(dtype))
            k_cache = cupy.asarray(rng.standard_normal((batch * capacity // 16 + 2, 16, heads_kv, d) if paged else
                                                       (batch, capacity, heads_kv, d), dtype=numpy.float32).astype(dtype))
            v_cache = k_cache.copy()
            new = cupy.asarray(rng.standard_normal((batch, 2, heads_kv, d), dtype=numpy.float32).astype(dtype))
            cache = dict(cache_seqlens=cupy.asarray([0, 77], dtype=cupy.int32), k_new=new, v_new=new)
            if paged:
                cache["block_table"] = cupy.asarray(rng.permutation(batch * capacity // 16 + 2)[:batch * capacity // 16]
                                                    .reshape(batch, -1).astype(numpy.int32))
            cupy_flash.flash_decode(q, k_cache, v_cache, causal=True, window_size=(40, -1), num_splits=splits, **cache)
            cupy.cuda.Device().synchronize()
            print("decode", dtype.__name__ if hasattr(dtype, "__name__") else dtype, "paged" if paged else "contiguous",
                  splits, "ok", flush=True)
    # FlashAttention-2's kvcache options: rows of a larger cache (one index outside it), padding
    # before each sequence's keys, rotary embedding of q and k_new (both pairings); then a paged
    # cache with padding and rotary.
    pool_k = cupy.asarray(rng.standard_normal((3, 96, 2, 72), dtype=numpy.float32).astype(dtype))
    pool_v = pool_k.copy()
    q = cupy.asarray(rng.standard_normal((2, 3, 8, 72), dtype=numpy.float32).astype(dtype))
    new = cupy.asarray(rng.standard_normal((2, 2, 2, 72), dtype=numpy.float32).astype(dtype))
    angles = numpy.arange(100)[:, None] * 0.01 * (numpy.arange(16) + 1)[None, :]
    cos, sin = (cupy.asarray(f(angles).astype(numpy.float32)).astype(dtype) for f in (numpy.cos, numpy.sin))
    for interleaved, index in ((False, [2, 0]), (True, [1, 7])):
        cupy_flash.flash_decode(q, pool_k, pool_v, cache_seqlens=cupy.asarray([40, 77], dtype=cupy.int32), k_new=new,
                                v_new=new, cache_batch_idx=cupy.asarray(index, dtype=cupy.int32),
                                cache_leftpad=cupy.asarray([9, 0], dtype=cupy.int32), rotary_cos=cos, rotary_sin=sin,
                                rotary_interleaved=interleaved, causal=True, num_splits=3)
    pages = cupy.asarray(rng.standard_normal((14, 16, 2, 72), dtype=numpy.float32).astype(dtype))
    table = cupy.asarray(rng.permutation(14)[:12].reshape(2, 6).astype(numpy.int32))
    cupy_flash.flash_decode(q, pages, pages.copy(), cache_seqlens=cupy.asarray([40, 77], dtype=cupy.int32), k_new=new,
                            v_new=new, block_table=table, cache_leftpad=cupy.asarray([33, 5], dtype=cupy.int32),
                            rotary_cos=cos, rotary_sin=sin, window_size=(20, -1))
    cupy.cuda.Device().synchronize()
    print("kvcache options ok", flush=True)
    # An FP8 cache (e4m3 bits, descales per (sequence, K/V head)): contiguous with an append over 3
    # splits, paged with padding, and 320 / 448 (v over two blocks).
    for d, d_v, paged in ((80, 80, False), (80, 80, True), (320, 448, True)):
        shape = (14, 16, 2) if paged else (2, 96, 2)
        k8, v8 = (cupy.asarray(rng.integers(0, 0x7e, shape + (n,), dtype=numpy.uint8)) for n in (d, d_v))
        q = cupy.asarray(rng.standard_normal((2, 2, 8, d), dtype=numpy.float32).astype(dtype))
        new_k, new_v = (cupy.asarray(rng.standard_normal((2, 1, 2, n), dtype=numpy.float32).astype(dtype)) for n in (d, d_v))
        descale = cupy.asarray(rng.random((2, 2), dtype=numpy.float32) + 0.01)
        cache = dict(block_table=cupy.asarray(rng.permutation(14)[:12].reshape(2, 6).astype(numpy.int32)),
                     cache_leftpad=cupy.asarray([33, 5], dtype=cupy.int32)) if paged else dict(num_splits=3)
        cupy_flash.flash_decode(q, k8, v8, cache_seqlens=cupy.asarray([40, 77], dtype=cupy.int32), k_new=new_k,
                                v_new=new_v, k_descale=descale, v_descale=descale, causal=True, **cache)
    # A packed prefill straight from pages (flash_forward's block_table): pages of 16, shuffled.
    lens_q, lens_k = [70, 0, 33], [45, 9, 130]
    q = cupy.asarray(rng.standard_normal((sum(lens_q), 4, 72), dtype=numpy.float32).astype(dtype))
    pages = cupy.asarray(rng.standard_normal((20, 16, 2, 72), dtype=numpy.float32).astype(dtype))
    table = cupy.asarray(numpy.resize(rng.permutation(20), 27).reshape(3, 9).astype(numpy.int32))   # pages reused
    cupy_flash.flash_forward(q, pages, pages.copy(), causal=True, block_table=table,
                             cu_seqlens_q=cupy.asarray(numpy.cumsum([0] + lens_q), dtype=cupy.int32),
                             cu_seqlens_k=cupy.asarray(numpy.cumsum([0] + lens_k), dtype=cupy.int32))
    cupy.cuda.Device().synchronize()
    print("fp8 cache and paged prefill ok", flush=True)
    # Wide head dims: 512 / 512 paged with an append over 3 splits (v over two blocks, the wide
    # combine), and merge_attention_states of 504 columns.
    k_cache = cupy.asarray(rng.standard_normal((13, 16, 1, 512), dtype=numpy.float32).astype(dtype))
    table = cupy.asarray(rng.permutation(13)[:12].reshape(2, 6).astype(numpy.int32))
    q = cupy.asarray(rng.standard_normal((2, 1, 16, 512), dtype=numpy.float32).astype(dtype))
    new = cupy.asarray(rng.standard_normal((2, 1, 1, 512), dtype=numpy.float32).astype(dtype))
    cupy_flash.flash_decode(q, k_cache, k_cache.copy(), cache_seqlens=cupy.asarray([90, 5], dtype=cupy.int32),
                            block_table=table, k_new=new, v_new=new, num_splits=3, causal=True)
    o_wide = cupy.asarray(rng.standard_normal((1, 3, 2, 504), dtype=numpy.float32).astype(dtype))
    lse_wide = cupy.asarray(rng.standard_normal((1, 2, 3), dtype=numpy.float32))
    cupy_flash.merge_attention_states([o_wide, o_wide, o_wide], [lse_wide, lse_wide, lse_wide])
    cupy.cuda.Device().synchronize()
    print("wide decode and merge ok", flush=True)
    # MLA (v the view of each latent row's first 512 columns): 128 heads x 2 causal tokens in pages
    # of 16 (a key tile crosses pages) with an append over 3 splits; 80 heads (a part-empty row
    # block) on a contiguous cache unsplit; on sm_90 the Hopper kernel, then the mma.sync one.
    for setting in ("auto", "portable"):
        with families.use_kernels(setting):
            pages = cupy.asarray(rng.standard_normal((20, 16, 1, 576), dtype=numpy.float32).astype(dtype))
            table = cupy.asarray(rng.permutation(20)[:18].reshape(2, 9).astype(numpy.int32))
            q = cupy.asarray(rng.standard_normal((2, 2, 128, 576), dtype=numpy.float32).astype(dtype))
            new = cupy.asarray(rng.standard_normal((2, 2, 1, 576), dtype=numpy.float32).astype(dtype))
            cupy_flash.flash_decode(q, pages, pages[..., :512], cache_seqlens=cupy.asarray([100, 3], dtype=cupy.int32),
                                    block_table=table, k_new=new, v_new=new[..., :512], num_splits=3, causal=True)
            latent = cupy.asarray(rng.standard_normal((2, 200, 1, 576), dtype=numpy.float32).astype(dtype))
            q = cupy.asarray(rng.standard_normal((2, 1, 80, 576), dtype=numpy.float32).astype(dtype))
            cupy_flash.flash_decode(q, latent, latent[..., :512], cache_seqlens=cupy.asarray([200, 70], dtype=cupy.int32),
                                    num_splits=1)
            cupy.cuda.Device().synchronize()
    print("mla decode ok", flush=True)
    # Calls back to back without a sync: on sm_90 each call's kernels are launched early
    # (_launch.py), so a decode kernel may be resident, prefetching its keys (contiguous or paged),
    # while the previous call's combine runs.
    k_cache = cupy.asarray(rng.standard_normal((1, 2048, 4, 128), dtype=numpy.float32).astype(dtype))
    lengths = cupy.asarray([2000], dtype=cupy.int32)
    table = cupy.asarray(rng.permutation(128).astype(numpy.int32).reshape(1, 128))
    for i in range(4):
        q = cupy.asarray(rng.standard_normal((1, 1, 32, 128), dtype=numpy.float32).astype(dtype))
        if i % 2:
            pages = k_cache.reshape(128, 16, 4, 128)
            cupy_flash.flash_decode(q, pages, pages, cache_seqlens=lengths, block_table=table)
        else:
            cupy_flash.flash_decode(q, k_cache, k_cache, cache_seqlens=lengths)
    cupy.cuda.Device().synchronize()
    print("back-to-back decode ok", flush=True)
    q = cupy.asarray(rng.standard_normal((2, 1, 8, 64), dtype=numpy.float32).astype(dtype))
    k = cupy.asarray(rng.standard_normal((2, 3000, 1, 64), dtype=numpy.float32).astype(dtype))
    o, lse = cupy_flash.flash_forward(q, k, k, causal=True)
    o2, lse2 = cupy_flash.flash_forward(q, k[:, :100], k[:, :100])
    cupy_flash.merge_attention_states([o, o2], [lse, lse2])
    cupy.cuda.Device().synchronize()
    print("split forward and merge ok", flush=True)
cupy.cuda.Device().synchronize()
print("sanitize workload done")
