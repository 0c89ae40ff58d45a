"""Small Hopper forward calls (kernels_cu/forward_sm90.cu) for compute-sanitizer's memcheck, racecheck
and synccheck: every head-dim tile, both dtypes, causal and not, a persistent grid whose blocks take
several tiles (more tiles than SMs), tiles that see no key, GQA, a window, softcap, a sink and a
packed batch with an empty sequence; the FP8 forward's; then the Hopper backward's; the MLA decode
kernel's. Exits with an error on a machine without a compute capability 9.0 GPU.

    compute-sanitizer --tool racecheck python bench/sanitize_sm90.py [forward | backward | fp8 | head_dim_v | wide | mla]

With `forward`, only the 16-bit forward's calls; with `backward`, only the backward's calls (the
forward's still run to give them O and lse); with `fp8`, only the FP8 calls' (the forward's, and
the backward's: the dequantisation, then the bf16 backward); with `head_dim_v`, only calls whose v
has a head_dim of its own (forward and backward); with `wide`, only the forward's 512 tile (v
blocks); with `mla`, only MLA decoding (decode_sm90.cu: TMA tiles and the zero-filled last one, 16-bit
and FP8 caches).
"""

# ruff: noqa: E402 - the imports follow the help guard, which must run first

from bench import help_first

help_first("sanitize_sm90", __doc__)

import sys

import cupy
import ml_dtypes
import numpy

import cupy_flash
from cupy_flash import families, forward

if families.current_device().compute_capability != 90:
    raise SystemExit("the Hopper kernels need a compute capability 9.0 GPU")
rng = numpy.random.default_rng(0)

def array(shape, dtype):
    return cupy.asarray(rng.standard_normal(shape, dtype=numpy.float32).astype(dtype))

part = sys.argv[1] if sys.argv[1:] else "all"
for dtype in (numpy.float16, ml_dtypes.bfloat16) if part in ("all", "forward") else ():
    for d in (40, 128, 160, 256):   # every head-dim tile (160: the 192 tile)
        for causal in (False, True):
            # 2 x 40 heads x 2 query blocks = 160 tiles: the persistent grid's blocks take two.
            q, k, v = array((2, 200, 40, d), dtype), array((2, 150, 8, d), dtype), array((2, 150, 8, d), dtype)
            cupy_flash.flash_forward(q, k, v, causal=causal)
    # Plain causal calls take the plain tiles (sm90.FORWARD_SM90_PLAIN: three consumers at d = 64)
    # from 2k keys; here at 150, so the counter hands their 160 tiles out. (The shape is the loop's
    # d = 40 causal call's: plain_causal_tiles_from drops that call's plan, which would be reused.)
    with forward.plain_causal_tiles_from(0):
        q, k, v = array((2, 200, 40, 40), dtype), array((2, 150, 8, 40), dtype), array((2, 150, 8, 40), dtype)
        cupy_flash.flash_forward(q, k, v, causal=True)
    q, k, v = array((1, 300, 4, 64), dtype), array((1, 100, 2, 64), dtype), array((1, 100, 2, 64), dtype)
    cupy_flash.flash_forward(q, k, v, causal=True)   # the first query block sees no key
    cupy_flash.flash_forward(q, k, v, window_size=(30, 5), softcap=5.0, sink=cupy.zeros(4, cupy.float32))
    lens_q, lens_k = [70, 0, 200], [45, 9, 130]
    q, k = array((sum(lens_q), 4, 64), dtype), array((sum(lens_k), 2, 64), dtype)
    cupy_flash.flash_forward(q, k, k, causal=True, cu_seqlens_q=cupy.asarray(numpy.cumsum([0] + lens_q), dtype=cupy.int32),
                             cu_seqlens_k=cupy.asarray(numpy.cumsum([0] + lens_k), dtype=cupy.int32))
    # d = 256 (a block per tile where tiles are unequal) under a window and in a packed batch.
    q, k, v = array((1, 300, 4, 256), dtype), array((1, 100, 2, 256), dtype), array((1, 100, 2, 256), dtype)
    cupy_flash.flash_forward(q, k, v, window_size=(30, 5))
    q, k = array((sum(lens_q), 4, 256), dtype), array((sum(lens_k), 2, 256), dtype)
    cupy_flash.flash_forward(q, k, k, causal=True, cu_seqlens_q=cupy.asarray(numpy.cumsum([0] + lens_q), dtype=cupy.int32),
                             cu_seqlens_k=cupy.asarray(numpy.cumsum([0] + lens_k), dtype=cupy.int32))
# The FP8 forward (the same kernel on e4m3, V^T written first by fp8_transpose_v): both head-dim
# tiles (d = 48 pads to 128), causal and not, GQA, rows that see no key, a window and a sink,
# a persistent grid with more tiles than SMs, keys off every 32-key group.
if part in ("all", "fp8"):
    for d in (48, 128, 256):
        for causal in (False, True):
            fp8 = [cupy_flash.quantize_fp8(array(shape, numpy.float32)) for shape in ((2, 300, 40, d), (2, 150, 8, d),
                                                                                      (2, 150, 8, d))]
            (q8, qd), (k8, kd), (v8, vd) = fp8
            o, lse = cupy_flash.flash_forward(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)
            with families.use_kernels("experimental"):   # GQA: q's descales per query head, then per K/V head
                cupy_flash.flash_backward(o, q8, k8, v8, o, lse, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)
                cupy_flash.flash_backward(o, q8, k8, v8, o, lse, causal=causal, q_descale=kd,
                                          k_descale=kd, v_descale=vd)
    cupy_flash.flash_forward(q8[:, :100], k8[:, :37], v8[:, :37], window_size=(20, 3), sink=cupy.zeros(40, cupy.float32),
                             q_descale=qd, k_descale=kd, v_descale=vd)
    # A packed batch with an empty sequence, keys off every 32-key group (V^T per sequence).
    lens_q, lens_k = [70, 0, 200], [45, 9, 130]
    cu_q, cu_k = (cupy.asarray(numpy.cumsum([0] + n), dtype=cupy.int32) for n in (lens_q, lens_k))
    for d in (64, 256):
        q8 = cupy.asarray(rng.integers(0, 120, (sum(lens_q), 4, d)), dtype=cupy.uint8)
        k8 = cupy.asarray(rng.integers(0, 120, (sum(lens_k), 2, d)), dtype=cupy.uint8)
        ones_q, ones_k = cupy.ones((3, 4), cupy.float32), cupy.ones((3, 2), cupy.float32)
        o, lse = cupy_flash.flash_forward(q8, k8, k8, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, q_descale=ones_q,
                                          k_descale=ones_k, v_descale=ones_k)
        with families.use_kernels("experimental"):
            cupy_flash.flash_backward(o, q8, k8, k8, o, lse, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                      q_descale=ones_q, k_descale=ones_k, v_descale=ones_k)
# The Hopper backward (kernels_cu/backward_sm90.cu; opted into with CUPY_FLASH_KERNELS=experimental):
# every head-dim tile (96 pads to 128; 192: its own tile, the product split), key blocks past the
# sequence, GQA, a window (at d = 160: the 256 tile's head-dim split), packed batches.
with families.use_kernels("experimental"):
    for dtype in (numpy.float16, ml_dtypes.bfloat16) if part in ("all", "backward") else ():
        for d in (64, 96, 128, 192, 256):
            for causal in (False, True):
                q, k, v = array((2, 200, 4, d), dtype), array((2, 150, 2, d), dtype), array((2, 150, 2, d), dtype)
                o, lse = cupy_flash.flash_forward(q, k, v, causal=causal)
                cupy_flash.flash_backward(array(q.shape, dtype), q, k, v, o, lse, causal=causal,
                                          deterministic=d in (64, 128, 256))   # the ordered dQ adds (turn counters)
        # Atomic at d = 128 (the loop's calls there are deterministic): the 80-query blocks
        # (sm90.BACKWARD_SM90_PLAIN), 200 queries ending inside the last block.
        q, k, v = array((2, 200, 4, 128), dtype), array((2, 150, 2, 128), dtype), array((2, 150, 2, 128), dtype)
        o, lse = cupy_flash.flash_forward(q, k, v)
        cupy_flash.flash_backward(array(q.shape, dtype), q, k, v, o, lse)
        # More key blocks than SMs: atomic calls' persistent blocks take several from the counter;
        # deterministic calls run a block per key block, each then finding the counter past the end.
        for d in (64, 128, 192, 256):
            q, k, v = array((1, 200, 160, d), dtype), array((1, 300, 160, d), dtype), array((1, 300, 160, d), dtype)
            for causal, deterministic in ((False, False), (True, True)):
                o, lse = cupy_flash.flash_forward(q, k, v, causal=causal)
                cupy_flash.flash_backward(array(q.shape, dtype), q, k, v, o, lse, causal=causal, deterministic=deterministic)
        # Deterministic plain calls past sm90.BACKWARD_SM90_DQ_APART_KEYS (the loops above compute
        # dQ apart: the dQ kernel): the main kernels' ordered adds.
        for d, causal in ((64, False), (128, True)):
            q, k, v = array((1, 300, 2, d), dtype), array((1, 2100, 2, d), dtype), array((1, 2100, 2, d), dtype)
            o, lse = cupy_flash.flash_forward(q, k, v, causal=causal)
            cupy_flash.flash_backward(array(q.shape, dtype), q, k, v, o, lse, causal=causal, deterministic=True)
        for d in (64, 160):
            q, k, v = array((1, 300, 2, d), dtype), array((1, 260, 2, d), dtype), array((1, 260, 2, d), dtype)
            o, lse = cupy_flash.flash_forward(q, k, v, window_size=(30, 5))
            cupy_flash.flash_backward(array(q.shape, dtype), q, k, v, o, lse, window_size=(30, 5))
        lens_q, lens_k = [70, 0, 200], [45, 9, 130]
        cu_q, cu_k = (cupy.asarray(numpy.cumsum([0] + n), dtype=cupy.int32) for n in (lens_q, lens_k))
        for d in (128, 256):
            q, k = array((sum(lens_q), 4, d), dtype), array((sum(lens_k), 2, d), dtype)
            o, lse = cupy_flash.flash_forward(q, k, k, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
            cupy_flash.flash_backward(array(q.shape, dtype), q, k, k, o, lse, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                      deterministic=d == 256)
if part in ("all", "head_dim_v"):
    # v's head_dim apart from q's (FEATURE_HEAD_DIM_V): DeepSeek's 192 / 128, v wider than q (whole
    # chunks of V's tile past q's head dim), GQA, causal and not, a packed batch, more tiles than SMs.
    with families.use_kernels("experimental"):
        for dtype in (numpy.float16, ml_dtypes.bfloat16):
            for d, d_v in ((192, 128), (64, 256), (128, 40)):
                for causal in (False, True):
                    q, k, v = array((2, 200, 40, d), dtype), array((2, 150, 8, d), dtype), array((2, 150, 8, d_v), dtype)
                    o, lse = cupy_flash.flash_forward(q, k, v, causal=causal)
                    cupy_flash.flash_backward(array(o.shape, dtype), q, k, v, o, lse, causal=causal,
                                              deterministic=causal)
            lens_q, lens_k = [70, 0, 200], [45, 9, 130]
            cu_q, cu_k = (cupy.asarray(numpy.cumsum([0] + n), dtype=cupy.int32) for n in (lens_q, lens_k))
            q, k = array((sum(lens_q), 4, 192), dtype), array((sum(lens_k), 2, 192), dtype)
            v = array((sum(lens_k), 2, 128), dtype)
            o, lse = cupy_flash.flash_forward(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
            cupy_flash.flash_backward(array(o.shape, dtype), q, k, v, o, lse, causal=True, cu_seqlens_q=cu_q,
                                      cu_seqlens_k=cu_k)
if part in ("all", "wide"):
    # The 512 tile (head dims 264-512, v blocks of 256): 512 / 512 and 264 / 264 (one v block past
    # nothing), 256 / 512 and 512 / 128 (one v block), causal and not, GQA, more tiles than SMs, the
    # first query block seeing no key, a window with softcap and a sink, a packed batch.
    for dtype in (numpy.float16, ml_dtypes.bfloat16):
        for d, d_v in ((512, 512), (264, 264), (256, 512), (512, 128)):
            for causal in (False, True):
                q, k, v = array((2, 200, 40, d), dtype), array((2, 150, 8, d), dtype), array((2, 150, 8, d_v), dtype)
                cupy_flash.flash_forward(q, k, v, causal=causal)
        q, k, v = array((1, 300, 4, 512), dtype), array((1, 100, 2, 512), dtype), array((1, 100, 2, 512), dtype)
        cupy_flash.flash_forward(q, k, v, causal=True)
        cupy_flash.flash_forward(q, k, v, window_size=(30, 5), softcap=5.0, sink=cupy.zeros(4, cupy.float32))
        lens_q, lens_k = [70, 0, 200], [45, 9, 130]
        cu_q, cu_k = (cupy.asarray(numpy.cumsum([0] + n), dtype=cupy.int32) for n in (lens_q, lens_k))
        q, k = array((sum(lens_q), 4, 512), dtype), array((sum(lens_k), 2, 512), dtype)
        cupy_flash.flash_forward(q, k, k, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
if part in ("all", "mla"):
    # MLA decoding (v the view of each latent row's first 576 - 64 columns): contiguous and paged
    # (pages of 16 and 128: boxes of a page's keys, and of a tile's), unsplit and split, 128 heads x 2
    # causal tokens and 80 heads x 1 (a part-empty row block); lengths that give whole tiles (TMA),
    # a last tile by cp.async past three tiles, a split of one partial tile, and an empty sequence;
    # 16-bit caches and FP8 ones (e4m3 bits, a descale per sequence: the tiles expanded in place).
    for dtype in (numpy.float16, ml_dtypes.bfloat16):
        for fp8 in (False, True):
            for page in (None, 16, 128):
                for heads, seqlen_q, splits in ((128, 2, 1), (80, 1, 3)):
                    lengths = cupy.asarray([300, 64, 0, 5], dtype=cupy.int32)
                    q = array((4, seqlen_q, heads, 576), dtype)
                    rows = (4, 320) if page is None else (4 * -(-320 // page), page)
                    cache = array(rows + (1, 576), dtype)
                    table = None if page is None else cupy.asarray(rng.permutation(rows[0]).astype(numpy.int32).reshape(4, -1))
                    scales = {}
                    if fp8:
                        cache = cupy.asarray(rng.integers(0, 0x7E, cache.shape, dtype=numpy.uint8))
                        scales = dict(k_descale=cupy.full((4, 1), 0.5, cupy.float32),
                                      v_descale=cupy.full((4, 1), 0.25, cupy.float32))
                    cupy_flash.flash_decode(q, cache, cache[..., :512], cache_seqlens=lengths, block_table=table,
                                            causal=seqlen_q > 1, num_splits=splits, **scales)
with families.use_kernels("experimental"):
    # Repeated plain calls on new arrays: the later ones take the kept plans (launches on new
    # addresses, tensor maps encoded for them, the backward's workspace).
    for _ in range(3):
        q = array((1, 1100, 4, 64), numpy.float16)
        k, v = array((1, 1100, 2, 64), numpy.float16), array((1, 1100, 2, 64), numpy.float16)
        o, lse = cupy_flash.flash_forward(q, k, v, causal=True)
        cupy_flash.flash_backward(array(q.shape, numpy.float16), q, k, v, o, lse, causal=True)
cupy.cuda.Device().synchronize()
print("sm90 sanitize workload done")
