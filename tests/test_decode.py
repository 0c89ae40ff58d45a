"""Decoding: flash_decode against a (paged) K/V cache, the split-KV path of flash_forward, and
merge_attention_states. Argument checks run on CPU; the rest needs the GPU."""

import numpy
import pytest
from helpers import (
    DTYPES,
    as_float64,
    bitwise,
    check_error_rule,
    count_example,
    draw_alibi_slopes,
    draw_window_and_softcap,
    input_magnitude,
    max_finite_abs,
    poisoned_allocations,
    random_array,
    requires_gpu,
)
from hypothesis import example, given
from hypothesis import strategies as st

import cupy_flash
from cupy_flash import attention_reference, decode_reference

# ---------------------------------------------------------------------------------------------
# Arguments (CPU: NumPy arrays stand in; every check runs before the arrays are taken).

def decode_arrays(batch=2, seqlen_q=1, heads=4, heads_kv=2, d=16, capacity=32, new=1, dtype=numpy.float16):
    rng = numpy.random.default_rng(0)
    return dict(q=rng.standard_normal((batch, seqlen_q, heads, d)).astype(dtype),
                k_cache=numpy.zeros((batch, capacity, heads_kv, d), dtype),
                v_cache=numpy.zeros((batch, capacity, heads_kv, d), dtype),
                cache_seqlens=numpy.array([3] * batch, numpy.int32),
                k_new=rng.standard_normal((batch, new, heads_kv, d)).astype(dtype),
                v_new=rng.standard_normal((batch, new, heads_kv, d)).astype(dtype))


BAD_DECODE = [
    ("float32 q", dict(q=numpy.zeros((2, 1, 4, 16), numpy.float32)), TypeError, "float16 or bfloat16"),
    ("k_cache dtype", dict(k_cache=numpy.zeros((2, 32, 2, 16), numpy.float32)), TypeError, "k_cache has dtype"),
    ("v_cache shape", dict(v_cache=numpy.zeros((2, 31, 2, 16), numpy.float16)), ValueError, "v_cache has shape"),
    ("heads", dict(k_cache=numpy.zeros((2, 32, 3, 16), numpy.float16), v_cache=numpy.zeros((2, 32, 3, 16), numpy.float16)),
     ValueError, "multiple of the K/V heads"),
    ("cache batch", dict(k_cache=numpy.zeros((3, 32, 2, 16), numpy.float16), v_cache=numpy.zeros((3, 32, 2, 16), numpy.float16)),
     ValueError, "k_cache has batch 3"),
    ("cache_seqlens dtype", dict(cache_seqlens=numpy.array([3, 3], numpy.int64)), TypeError, "cache_seqlens has dtype"),
    ("cache_seqlens shape", dict(cache_seqlens=numpy.array([3], numpy.int32)), ValueError, "cache_seqlens has shape"),
    ("k_new alone", dict(v_new=None), ValueError, "k_new and v_new"),
    ("v_cache head_dim", dict(v_cache=numpy.zeros((2, 32, 2, 12), numpy.float16)), ValueError,
     "v_cache has head_dim 12; expected a multiple of 8"),
    # q and k take MLA's 576 (decoding only), v at most 512.
    ("q head_dim past 576", dict(q=numpy.zeros((2, 1, 4, 584), numpy.float16)), ValueError,
     "q has head_dim 584; expected a multiple of 8 from 8 to 576"),
    ("v_cache head_dim past 512", dict(v_cache=numpy.zeros((2, 32, 2, 576), numpy.float16)), ValueError,
     "v_cache has head_dim 576; expected a multiple of 8 from 8 to 512"),
    ("v_new head_dim", dict(v_cache=numpy.zeros((2, 32, 2, 8), numpy.float16)), ValueError,
     r"v_new has shape \(2, 1, 2, 16\); expected \(batch, seqlen_new, heads_kv, head_dim\) = \(2, \*, 2, 8\)"),
    ("k_new heads", dict(k_new=numpy.zeros((2, 1, 4, 16), numpy.float16), v_new=numpy.zeros((2, 1, 4, 16), numpy.float16)),
     ValueError, "k_new has shape"),
    ("block_table page size", dict(k_cache=numpy.zeros((4, 24, 2, 16), numpy.float16), v_cache=numpy.zeros((4, 24, 2, 16), numpy.float16),
                                   block_table=numpy.zeros((2, 2), numpy.int32)), ValueError, "power of two from 16"),
    ("block_table dtype", dict(block_table=numpy.zeros((2, 2), numpy.int64)), TypeError, "block_table has dtype"),
    ("block_table batch", dict(k_cache=numpy.zeros((5, 16, 2, 16), numpy.float16), v_cache=numpy.zeros((5, 16, 2, 16), numpy.float16),
                               block_table=numpy.zeros((3, 2), numpy.int32)), ValueError, "block_table has shape"),
    # FlashAttention-2's kvcache options
    ("cache_batch_idx dtype", dict(cache_batch_idx=numpy.zeros(2, numpy.int64)), TypeError, "cache_batch_idx has dtype"),
    ("cache_batch_idx shape", dict(cache_batch_idx=numpy.zeros(3, numpy.int32)), ValueError, "cache_batch_idx has shape"),
    ("cache_batch_idx paged", dict(k_cache=numpy.zeros((4, 16, 2, 16), numpy.float16), v_cache=numpy.zeros((4, 16, 2, 16), numpy.float16),
                                   block_table=numpy.zeros((2, 2), numpy.int32), cache_batch_idx=numpy.zeros(2, numpy.int32)),
     ValueError, "cache_batch_idx is not supported with block_table"),
    ("cache_leftpad shape", dict(cache_leftpad=numpy.zeros((2, 1), numpy.int32)), ValueError, "cache_leftpad has shape"),
    ("rotary alone", dict(rotary_cos=numpy.zeros((32, 4), numpy.float16)), ValueError, "rotary_cos and rotary_sin"),
    ("rotary dtype", dict(rotary_cos=numpy.zeros((32, 4), numpy.float32), rotary_sin=numpy.zeros((32, 4), numpy.float32)),
     TypeError, "rotary_cos has dtype float32"),
    ("rotary too wide", dict(rotary_cos=numpy.zeros((32, 9), numpy.float16), rotary_sin=numpy.zeros((32, 9), numpy.float16)),
     ValueError, "rotary_dim must be 2 to head_dim = 16"),
    ("rotary too short", dict(rotary_cos=numpy.zeros((31, 4), numpy.float16), rotary_sin=numpy.zeros((31, 4), numpy.float16)),
     ValueError, "rotary_cos has 31 rows but the cache holds 32 keys"),
    ("rotary shapes", dict(rotary_cos=numpy.zeros((32, 4), numpy.float16), rotary_sin=numpy.zeros((32, 2), numpy.float16)),
     ValueError, "rotary_sin has shape"),
    # An FP8 cache: uint8 k_cache and v_cache (e4m3 bits) with float32 descales.
    ("fp8 cache mixed", dict(k_cache=numpy.zeros((2, 32, 2, 16), numpy.uint8)), TypeError,
     "k_cache holds FP8 bits \\(uint8\\) but v_cache has dtype float16"),
    ("fp8 descale missing", dict(k_cache=numpy.zeros((2, 32, 2, 16), numpy.uint8), v_cache=numpy.zeros((2, 32, 2, 16), numpy.uint8),
                                 k_descale=numpy.ones((2, 2), numpy.float32)), ValueError, "v_descale is missing"),
    ("descale without fp8", dict(k_descale=numpy.ones((2, 2), numpy.float32)), ValueError,
     "k_descale is for an FP8 cache"),
    ("fp8 head_dim", dict(k_cache=numpy.zeros((2, 32, 2, 16), numpy.uint8), v_cache=numpy.zeros((2, 32, 2, 8), numpy.uint8),
                          k_descale=numpy.ones(2, numpy.float32), v_descale=numpy.ones(2, numpy.float32)), ValueError,
     "v_cache has head_dim 8; an FP8 cache's rows are read in 16-byte units"),
    ("fp8 descale shape", dict(k_cache=numpy.zeros((2, 32, 2, 16), numpy.uint8), v_cache=numpy.zeros((2, 32, 2, 16), numpy.uint8),
                               k_descale=numpy.ones((3, 2), numpy.float32), v_descale=numpy.ones(2, numpy.float32)), ValueError,
     "k_descale has shape \\(3, 2\\); expected \\(batch, heads_kv\\)"),
    ("fp8 descale dtype", dict(k_cache=numpy.zeros((2, 32, 2, 16), numpy.uint8), v_cache=numpy.zeros((2, 32, 2, 16), numpy.uint8),
                               k_descale=numpy.ones(2, numpy.float32), v_descale=numpy.ones(2, numpy.float64)), TypeError,
     "v_descale has dtype float64; expected float32"),
    ("rotary_interleaved", dict(rotary_cos=numpy.zeros((32, 4), numpy.float16), rotary_sin=numpy.zeros((32, 4), numpy.float16),
                                rotary_interleaved="yes"), TypeError, "rotary_interleaved"),
    # v_cache=None: v the first head_dim_v columns of k's rows (MLA's latent cache, where views cannot be passed).
    ("v_cache None alone", dict(v_cache=None, v_new=None), ValueError, "v_cache is None: pass head_dim_v"),
    ("head_dim_v type", dict(v_cache=None, v_new=None, head_dim_v=8.0), TypeError, "head_dim_v must be an int, got float"),
    ("head_dim_v past k's", dict(v_cache=None, v_new=None, head_dim_v=24), ValueError,
     "head_dim_v is 24; with v_cache=None expected a multiple of 8 from 8 to 16"),
    ("head_dim_v with v_new", dict(v_cache=None, head_dim_v=8), ValueError, "v_new must be None where v_cache is None"),
    ("head_dim_v beside v_cache", dict(head_dim_v=8), ValueError, "head_dim_v is 8 but v_cache has head_dim 16"),
    ("head_dim_v with rotary", dict(v_cache=None, v_new=None, head_dim_v=8, rotary_cos=numpy.zeros((32, 4), numpy.float16),
                                    rotary_sin=numpy.zeros((32, 4), numpy.float16)), ValueError,
     "rotary_cos / rotary_sin are not supported where v_cache is None"),
    ("head_dim_v reaches the checks", dict(v_cache=None, v_new=None, head_dim_v=8,
                                           cache_seqlens=numpy.array([3, 3], numpy.int64)), TypeError,
     "cache_seqlens has dtype"),
]


@pytest.mark.parametrize("label, change, error, message", BAD_DECODE, ids=[c[0] for c in BAD_DECODE])
def test_decode_bad_arguments(label, change, error, message):
    arrays = decode_arrays()
    arrays.update(change)
    with pytest.raises(error, match=message):
        cupy_flash.flash_decode(arrays.pop("q"), arrays.pop("k_cache"), arrays.pop("v_cache"), **arrays)


def test_decode_rotary_refused_where_v_shares_k_memory():
    """Rotary with new rows where v_cache is a view of k_cache (MLA's latent cache): the rotated k row
    and the unrotated v row would be written into the same memory, so the call is refused by name
    before any launch; without new rows the views are not refused by this check."""
    arrays = decode_arrays()
    k_cache = arrays["k_cache"]
    rotary = dict(rotary_cos=numpy.zeros((32, 4), numpy.float16), rotary_sin=numpy.zeros((32, 4), numpy.float16))
    with pytest.raises(ValueError, match="rotary_cos / rotary_sin are not supported where v_cache shares memory"):
        cupy_flash.flash_decode(arrays["q"], k_cache, k_cache[..., :8], cache_seqlens=arrays["cache_seqlens"],
                                k_new=arrays["k_new"], v_new=arrays["k_new"][..., :8], **rotary)
    with pytest.raises(Exception) as caught:   # (past the checks, the CPU stand-ins fail elsewhere)
        cupy_flash.flash_decode(arrays["q"], k_cache, k_cache[..., :8], cache_seqlens=arrays["cache_seqlens"], **rotary)
    assert "shares memory" not in str(caught.value)
    from cupy_flash._checks import may_share_memory

    fused = numpy.zeros((2, 32, 2, 32), numpy.float16)   # k and v side by side in one buffer
    assert not may_share_memory(fused[..., :16], fused[..., 16:]) and may_share_memory(fused[..., :16], fused[..., 8:24])
    assert may_share_memory(k_cache, k_cache[..., 8:]) and not may_share_memory(k_cache, arrays["v_cache"])
    assert not may_share_memory(k_cache[:1], k_cache[1:]) and may_share_memory(k_cache, k_cache[:, ::2])


def test_choose_splits(monkeypatch):
    """The automatic split count on a 132-SM GPU: while the work fits on the SMs, as many splits as
    keep one block per SM; past that, about one wave of the blocks an SM holds (three at head_dim
    128, one at 256 by shared memory); past 32, whole passes of the combine (32 splits each); 128 keys
    or more per split, at most MAX_AUTO_SPLITS."""
    from cupy_flash import decode, families

    monkeypatch.setattr(decode, "device_info", lambda device: families.DeviceInfo(90, 227 * 1024, 132))
    assert decode.choose_splits(4, 32768, 128, 0) == 32                               # GQA 8:1, batch 1
    assert decode.choose_splits(2, 32768, 128, 0) == 64                               # MQA, batch 1
    assert decode.choose_splits(1, 32768, 128, 0) == decode.MAX_AUTO_SPLITS == 64
    assert decode.choose_splits(3, 32768, 128, 0) == 32          # 44 splits: whole combine passes
    assert decode.choose_splits(32, 32768, 128, 0) == 4                               # 1:1, batch 1
    assert decode.choose_splits(32, 32768, 256, 0) == 4
    assert decode.choose_splits(64, 32768, 128, 0) == 2
    assert decode.choose_splits(96, 32768, 128, 0) == 1
    assert decode.choose_splits(132, 32768, 128, 0) == 1
    assert decode.choose_splits(192, 32768, 128, 0) == 2                              # three per SM
    assert decode.choose_splits(192, 32768, 256, 0) == 1
    assert decode.choose_splits(4, 1000, 128, 0) == 7                                 # 128+ keys each
    assert decode.choose_splits(4, 100, 128, 0) == 1


def test_combine_launch_slices_wide_rows():
    """The combine's grid: a block per row up to WIDE_TILE columns, a block per 128-column slice of a
    row above (MLA's 512: four), always a whole number of slices (the kernel reads a block's slice
    as blockIdx.x % slices and strides rows by gridDim.x / slices) and within CUDA's grid limit;
    warps by the splits (COMBINE_BATCH each, at most COMBINE_MAX_WARPS)."""
    from cupy_flash import _traits
    from cupy_flash.families import decode as family

    assert family.combine_launch(128, 64, 512) == ((512,), (32 * _traits.COMBINE_MAX_WARPS,))
    assert family.combine_launch(128, 3, 256) == ((128,), (32,))
    assert family.combine_launch(7, 5, 264) == ((21,), (64,))    # 264 columns: three slices, the last short
    grid = family.combine_launch(2**31, 2, 504)[0][0]
    assert grid % 4 == 0 and grid <= 2**31 - 1
    assert family.combine_launch(2**31, 2, 128)[0][0] == 2**31 - 1


def test_mla_sm90_dispatch():
    """The Hopper MLA kernel takes 16-bit and FP8 caches of MLA's tile on compute capability 9.0
    whose k a tensor map can read, unless the kernels setting is "portable"; its TMA boxes hold a
    tile's keys or a page's where pages are shorter."""
    from types import SimpleNamespace

    from cupy_flash import _traits, families
    from cupy_flash.families import decode as family

    h100, a100 = families.DeviceInfo(90, 227 * 1024, 132), families.DeviceInfo(80, 163 * 1024, 108)
    shape = SimpleNamespace(tile=_traits.MLA_SM90_D_TILE)
    bf16, fp8 = SimpleNamespace(fp8_cache=False), SimpleNamespace(fp8_cache=True)
    assert family.uses_mla_sm90(h100, shape, bf16, True, "auto")
    assert not family.uses_mla_sm90(h100, shape, bf16, False, "auto")         # k not TMA-readable
    assert not family.uses_mla_sm90(h100, shape, bf16, True, "portable")
    assert family.uses_mla_sm90(h100, shape, fp8, True, "auto")
    assert not family.uses_mla_sm90(h100, shape, fp8, True, "portable")
    assert not family.uses_mla_sm90(a100, shape, bf16, True, "auto")
    assert not family.uses_mla_sm90(h100, SimpleNamespace(tile=512), bf16, True, "auto")
    assert [family.mla_sm90_box_keys(page) for page in (None, 16, 32, 64, 256)] == [64, 16, 32, 64, 64]


def test_early_launch_structs_match_cuda_h():
    """_launch's ctypes mirrors of CUlaunchAttribute and CUlaunchConfig have cuda.h's layout (a
    wrong offset would hand the driver a garbage stream or attribute)."""
    import ctypes

    from cupy_flash import _launch

    assert ctypes.sizeof(_launch._LaunchAttribute) == 72
    assert _launch._LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(_launch._LaunchConfig) == 56
    assert (_launch._LaunchConfig.shared_mem_bytes.offset, _launch._LaunchConfig.stream.offset,
            _launch._LaunchConfig.attrs.offset, _launch._LaunchConfig.num_attrs.offset) == (24, 32, 40, 48)


@pytest.mark.parametrize("num_splits, error", [(0, ValueError), (1000, ValueError), (2.0, TypeError), (True, TypeError)])
def test_num_splits_checked(num_splits, error):
    arrays = decode_arrays()
    with pytest.raises(error, match="num_splits"):
        cupy_flash.flash_decode(arrays.pop("q"), arrays.pop("k_cache"), arrays.pop("v_cache"), num_splits=num_splits, **arrays)


BAD_MERGE = [
    ("empty", [], [], ValueError, "outputs is empty"),
    ("count", [numpy.zeros((1, 2, 3, 8), numpy.float32)] * 2, [numpy.zeros((1, 3, 2), numpy.float32)], ValueError, "one lse per output"),
    ("shape", [numpy.zeros((1, 2, 3, 8), numpy.float32), numpy.zeros((1, 2, 3, 16), numpy.float32)],
     [numpy.zeros((1, 3, 2), numpy.float32)] * 2, ValueError, r"outputs\[1\] has shape"),
    ("lse dtype", [numpy.zeros((1, 2, 3, 8), numpy.float32)], [numpy.zeros((1, 3, 2), numpy.float64)], TypeError, "float32"),
    ("lse shape", [numpy.zeros((1, 2, 3, 8), numpy.float32)], [numpy.zeros((1, 2, 3), numpy.float32)], ValueError, r"lses\[0\] has shape"),
    ("not a list", numpy.zeros((1, 2, 3, 8), numpy.float32), numpy.zeros((1, 3, 2), numpy.float32), TypeError, "lists"),
]


@pytest.mark.parametrize("label, outputs, lses, error, message", BAD_MERGE, ids=[c[0] for c in BAD_MERGE])
def test_merge_bad_arguments(label, outputs, lses, error, message):
    with pytest.raises(error, match=message):
        cupy_flash.merge_attention_states(outputs, lses)


# ---------------------------------------------------------------------------------------------
# flash_decode against the dense reference (GPU).

@st.composite
def decode_problems(draw):
    heads_kv = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 4, 8]))
    batch = draw(st.integers(1, 3))
    seqlen_q = draw(st.one_of(st.just(1), st.integers(1, 9)))
    new = draw(st.one_of(st.just(0), st.integers(1, seqlen_q + 2)))
    paged = draw(st.booleans())
    page_size = draw(st.sampled_from([16, 32, 64, 256])) if paged else None
    capacity = draw(st.one_of(st.integers(new + 1, 300), st.integers(300, 3000)))
    if paged:
        capacity = -(-capacity // page_size) * page_size
    lengths = draw(st.lists(st.integers(0, capacity - new), min_size=batch, max_size=batch))
    # Multiples of 8 up to 256 mostly; one time in five the wide tiles' (264-512, v split over blocks).
    eights = st.one_of(*(st.integers(1, 32),) * 4, st.integers(33, 64)).map(lambda n: 8 * n)
    head_dim = draw(eights)
    features = {}
    if draw(st.booleans()):
        features.update(draw_window_and_softcap(draw, 1000))
        if draw(st.booleans()):
            features["alibi_slopes"] = draw_alibi_slopes(draw, heads_kv * group)
        if draw(st.booleans()):
            features["sink"] = draw(st.lists(st.floats(-4.0, 4.0), min_size=heads_kv * group, max_size=heads_kv * group))
    # FlashAttention-2's kvcache options, each a third of the time: the sequences' rows of a larger
    # contiguous cache, padding before each sequence's keys, rotary embedding of q and k_new.
    kvcache = {}
    if not paged and draw(st.integers(0, 2)) == 0:
        rows = batch + draw(st.integers(0, 2))
        kvcache["cache_batch_idx"] = draw(st.permutations(range(rows)))[:batch]
    if draw(st.integers(0, 2)) == 0:
        kvcache["cache_leftpad"] = [draw(st.integers(0, n)) for n in lengths]
    if draw(st.integers(0, 2)) == 0:
        kvcache["rotary_dim"] = 2 * draw(st.integers(1, head_dim // 2))
        kvcache["rotary_interleaved"] = draw(st.booleans())
        kvcache["seqlen_ro"] = capacity + draw(st.integers(0, 5))
    head_dim_v = draw(st.one_of(st.just(head_dim), eights, st.just(512)))
    # MLA one time in six (DeepSeek's latent cache): one K/V head of 576 columns, v its first 512
    # (a view of k_cache half the time, as FlashMLA reads it), 16-128 query heads, one or two tokens.
    v_in_k = False
    if draw(st.integers(0, 5)) == 0:
        heads_kv, group, head_dim, head_dim_v = 1, draw(st.sampled_from([16, 32, 64, 128])), 576, 512
        seqlen_q = draw(st.integers(1, 2))
        new = min(new, seqlen_q)
        v_in_k = draw(st.booleans())
        if "alibi_slopes" in features:
            features["alibi_slopes"] = draw_alibi_slopes(draw, group)
        if "sink" in features:
            features["sink"] = draw(st.lists(st.floats(-4.0, 4.0), min_size=group, max_size=group))
        if v_in_k:   # rotary would turn k's first columns but not v's: a view cannot take both
            for name in ("rotary_dim", "rotary_interleaved", "seqlen_ro"):
                kvcache.pop(name, None)
    # An FP8 cache a third of the time (head dims rounded up to multiples of 16): descales per K/V
    # head from the cache's largest magnitude times `fit` (0.5: the largest values saturate), given
    # as (heads_kv,) or (batch, heads_kv).
    fp8 = None
    if draw(st.integers(0, 2)) == 0:
        head_dim, head_dim_v = (-(-d // 16) * 16 for d in (head_dim, head_dim_v))
        fp8 = dict(fit=draw(st.sampled_from([0.5, 1.0, 3.0])), per_batch=draw(st.booleans()))
    return dict(dtype=draw(st.sampled_from(["float16", "bfloat16"])), batch=batch, heads_kv=heads_kv, heads=heads_kv * group,
                seqlen_q=seqlen_q, new=new, capacity=capacity, page_size=page_size, lengths=lengths,
                head_dim=head_dim, head_dim_v=head_dim_v, fp8=fp8, v_in_k=v_in_k,
                causal=draw(st.booleans()), features=features,
                num_splits=draw(st.one_of(st.none(), st.integers(1, 9), st.just(128))),
                logit_std=draw(st.sampled_from([0.3, 1.0, 3.0, 30.0])), seed=draw(st.integers(0, 2**32 - 1)),
                kvcache=kvcache)


def make_decode_inputs(p):
    """(q, cache arrays as flash_decode takes them, the same cache contiguous for the reference)."""
    import cupy

    rng = numpy.random.default_rng(p["seed"])
    d, d_v = p["head_dim"], p.get("head_dim_v", p["head_dim"])
    magnitude = input_magnitude(p)
    q = random_array(rng, (p["batch"], p["seqlen_q"], p["heads"], d), p["dtype"], magnitude)
    shape = (p["batch"], p["capacity"], p["heads_kv"], d)
    k_dense = random_array(rng, shape, p["dtype"], magnitude)
    # v_in_k (MLA): v is k's first d_v columns, a view of the same memory throughout.
    v_in_k = p.get("v_in_k", False)
    v_dense = k_dense[..., :d_v] if v_in_k else random_array(rng, shape[:-1] + (d_v,), p["dtype"])
    new = None
    if p["new"]:
        new_shape = (p["batch"], p["new"], p["heads_kv"], d)
        k_new = random_array(rng, new_shape, p["dtype"], magnitude)
        new = (k_new, k_new[..., :d_v] if v_in_k else random_array(rng, new_shape[:-1] + (d_v,), p["dtype"]))
    cache = dict(cache_seqlens=cupy.asarray(p["lengths"], dtype=cupy.int32))
    if p["page_size"]:
        pages_per = p["capacity"] // p["page_size"]
        # Pages in a shuffled order with spare pages between, so a wrong page index reads other data.
        order = rng.permutation(p["batch"] * pages_per + 3)[:p["batch"] * pages_per]
        table = order.reshape(p["batch"], pages_per).astype(numpy.int32)
        pool_shape = (p["batch"] * pages_per + 3, p["page_size"], p["heads_kv"], d)
        k_pages, v_pages = (random_array(rng, pool_shape[:-1] + (n,), p["dtype"]) for n in (d, d_v))
        if v_in_k:
            v_pages = k_pages[..., :d_v]
        flat = cupy.asarray(table.reshape(-1))
        k_bits, v_bits = k_pages.view(cupy.uint16), v_pages.view(cupy.uint16)
        k_bits[flat] = k_dense.view(cupy.uint16).reshape(-1, p["page_size"], p["heads_kv"], d)
        v_bits[flat] = v_dense.view(cupy.uint16).reshape(-1, p["page_size"], p["heads_kv"], d_v)
        k_cache, v_cache, cache["block_table"] = k_pages, v_pages, cupy.asarray(table)
    elif "cache_batch_idx" in p.get("kvcache", {}):
        # The sequences' rows among others of a larger cache (a wrong row reads other data).
        index = p["kvcache"]["cache_batch_idx"]
        pool = (max(index) + 1, p["capacity"], p["heads_kv"])
        k_cache, v_cache = random_array(rng, pool + (d,), p["dtype"]), random_array(rng, pool + (d_v,), p["dtype"])
        if v_in_k:
            v_cache = k_cache[..., :d_v]
        for b, row in enumerate(index):
            copy_bits(k_cache[row], k_dense[b])
            copy_bits(v_cache[row], v_dense[b])
        cache["cache_batch_idx"] = cupy.asarray(index, dtype=cupy.int32)
    else:
        k_cache = k_dense.copy()
        v_cache = k_cache[..., :d_v] if v_in_k else v_dense.copy()
    kvcache = p.get("kvcache", {})
    if "cache_leftpad" in kvcache:
        cache["cache_leftpad"] = cupy.asarray(kvcache["cache_leftpad"], dtype=cupy.int32)
    if "rotary_dim" in kvcache:
        # Real angles (positions x frequencies), as a model's tables hold them, in q's dtype.
        half = kvcache["rotary_dim"] // 2
        angles = numpy.arange(kvcache["seqlen_ro"])[:, None] * 10000.0 ** (-numpy.arange(half) / half)[None, :]
        cache["rotary_cos"], cache["rotary_sin"] = (cupy.asarray(f(angles).astype(numpy.float32)).astype(q.dtype)
                                                    for f in (numpy.cos, numpy.sin))
        cache["rotary_interleaved"] = kvcache["rotary_interleaved"]
    if new is not None:
        cache["k_new"], cache["v_new"] = new
    if p.get("fp8") and v_in_k:   # one e4m3 cache, one descale, v its first columns
        k_cache = fp8_cache(k_cache, "k", p, cache)
        v_cache, cache["v_descale"] = k_cache[..., :d_v], cache["k_descale"]
    elif p.get("fp8"):
        k_cache, v_cache = (fp8_cache(x, n, p, cache) for x, n, in ((k_cache, "k"), (v_cache, "v")))
    return q, k_cache, v_cache, cache, (k_dense, v_dense)


def fp8_cache(x, name: str, p, cache):
    """The cache x in FP8: e4m3 bits of x / descale with a descale per K/V head (the largest magnitude
    of x and the new rows over 448, times p["fp8"]["fit"]), written into cache[name + "_descale"]."""
    import cupy

    from cupy_flash.fp8 import encode_fp8

    values = as_float64(x)
    largest = abs(values).max(axis=(0, 1, 3))
    if f"{name}_new" in cache:
        largest = cupy.maximum(largest, abs(as_float64(cache[f"{name}_new"])).max(axis=(0, 1, 3)))
    descale = (cupy.maximum(largest, 1e-3) / 448 * p["fp8"]["fit"]).astype(cupy.float32)
    bits = encode_fp8(values / descale.astype(cupy.float64)[:, None])
    if p["fp8"]["per_batch"]:
        descale = cupy.ascontiguousarray(cupy.broadcast_to(descale, (p["batch"], p["heads_kv"])))
    cache[f"{name}_descale"] = descale
    return bits


def copy_bits(dst, src):
    """dst[...] = src for 16-bit floats, as their bits (no bfloat16 arithmetic needed); FP8 bits as they are."""
    import cupy

    if dst.dtype == cupy.uint8:
        dst[...] = src
    else:
        dst.view(cupy.uint16)[...] = src.view(cupy.uint16)


def decode_options(p):
    import cupy

    features = dict(p["features"])
    for name in ("alibi_slopes", "sink"):
        if name in features:
            features[name] = cupy.asarray(features[name], dtype=cupy.float32)
    return dict(causal=p["causal"], **features)


@requires_gpu
@given(decode_problems())
# 512 / 512 (v over two blocks), 16 query heads a K/V head, a new token appended into pages of 64,
# three splits (the wide combine).
@example(dict(dtype="bfloat16", batch=2, heads_kv=1, heads=16, seqlen_q=1, new=1, capacity=1024, page_size=64,
              lengths=[1000, 77], head_dim=512, head_dim_v=512, causal=True, features={}, num_splits=3, logit_std=3.0,
              seed=512))
# q and k 320, v 448 (tile 448: two blocks of 224 columns), three queries, a window.
@example(dict(dtype="float16", batch=1, heads_kv=2, heads=4, seqlen_q=3, new=0, capacity=700, page_size=None,
              lengths=[650], head_dim=320, head_dim_v=448, causal=True, features={"window_size": (300, 0)},
              num_splits=None, logit_std=1.0, seed=320))
# An FP8 cache: e4m3 keys and values in scattered pages, saturating descales given per
# (batch, K/V head), two new tokens appended (quantised), GQA 4:1, three splits.
@example(dict(dtype="bfloat16", batch=2, heads_kv=2, heads=8, seqlen_q=2, new=2, capacity=512, page_size=32,
              lengths=[300, 5], head_dim=128, head_dim_v=128, causal=True, features={}, num_splits=3, logit_std=1.0,
              seed=8, fp8=dict(fit=0.5, per_batch=True)))
# MLA: 128 query heads over one latent K/V head of 576 columns in pages of 64, v the view of its
# first 512, two tokens appended (speculative decoding), causal.
@example(dict(dtype="bfloat16", batch=2, heads_kv=1, heads=128, seqlen_q=2, new=2, capacity=1024, page_size=64,
              lengths=[900, 13], head_dim=576, head_dim_v=512, v_in_k=True, causal=True, features={}, num_splits=None,
              logit_std=3.0, seed=576))
# MLA from an e4m3 cache (one descale for the latent and its view), 16 heads, one token, three splits.
@example(dict(dtype="float16", batch=1, heads_kv=1, heads=16, seqlen_q=1, new=1, capacity=700, page_size=None,
              lengths=[650], head_dim=576, head_dim_v=512, v_in_k=True, causal=False, features={}, num_splits=3,
              logit_std=1.0, seed=577, fp8=dict(fit=1.0, per_batch=False)))
def test_decode_matches_reference(p):

    from cupy_flash.reference import rotate

    count_example("decode_matches_reference")
    q, k_cache, v_cache, cache, _ = make_decode_inputs(p)
    opts = decode_options(p)
    k_before, v_before = k_cache.copy(), v_cache.copy()
    with poisoned_allocations():
        o, lse = cupy_flash.flash_decode(q, k_cache, v_cache, num_splits=p["num_splits"], **cache, **opts)
    context = str(p)
    # The append wrote exactly rows lengths[b] .. + new of each sequence (rotated k_new: the same
    # float32 operations as the kernel's, so bitwise too), and nothing else.
    expect_k, expect_v = k_before.copy(), v_before.copy()
    if p["new"]:
        k_rows, v_rows = cache["k_new"], cache["v_new"]
        if "rotary_cos" in cache:
            k_rows = rotate(k_rows, cache["rotary_cos"], cache["rotary_sin"], cache["cache_seqlens"], True,
                            cache["rotary_interleaved"])
        if p.get("fp8"):   # the rows' e4m3 bits, as quantize_fp8 rounds x / descale
            from cupy_flash.fp8 import encode_fp8

            k_rows, v_rows = (encode_fp8(as_float64(x) / cache[n].reshape(-1, p["heads_kv"])[0].astype(numpy.float64)[:, None])
                              for x, n in ((k_rows, "k_descale"), (v_rows, "v_descale")))
        index = p.get("kvcache", {}).get("cache_batch_idx", list(range(p["batch"])))
        for b, length in enumerate(p["lengths"]):
            for t in range(p["new"]):
                if p["page_size"]:
                    page = int(cache["block_table"][b, (length + t) // p["page_size"]])
                    at = (page, (length + t) % p["page_size"])
                else:
                    at = (index[b], length + t)
                copy_bits(expect_k[at], k_rows[b, t])
                copy_bits(expect_v[at], v_rows[b, t])
    assert bool((bitwise(k_cache) == bitwise(expect_k)).all()), "k_cache: the append wrote the wrong rows " + context
    assert bool((bitwise(v_cache) == bitwise(expect_v)).all()), "v_cache: the append wrote the wrong rows " + context
    # Results against the reference, given the call's own arguments and the caches as they were.
    exact = decode_reference(q, k_before, v_before, **cache, **opts)
    low = decode_reference(q, k_before, v_before, upcast=False, **cache, **opts)
    assert o.shape == q.shape[:-1] + v_cache.shape[-1:] and o.dtype == q.dtype
    assert lse.shape == (p["batch"], p["heads"], p["seqlen_q"])
    magnitude = max_finite_abs(exact[1])
    check_error_rule("decode o", o, exact[0], low[0], context, magnitude)
    check_error_rule("decode lse", lse, exact[1], low[1], context, magnitude)


@requires_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fp8_cache_reads_every_e4m3_code_exactly(dtype):
    """One cached key whose K and V rows hold the 254 finite e4m3 codes (subnormals and both zeros
    among them): with q = e_h for head h and scale 1, lse[h] is k's code h, and o (a single key's
    softmax is 1) is v's row exactly."""
    import cupy

    from cupy_flash.fp8 import decode_fp8

    codes = numpy.array([c if c & 0x7F != 0x7F else 0 for c in range(256)], numpy.uint8)   # NaN codes as 0
    d = 256
    k_cache = cupy.zeros((1, 16, 1, d), cupy.uint8)
    v_cache = cupy.zeros((1, 16, 1, d), cupy.uint8)
    k_cache[0, 0, 0] = cupy.asarray(codes)
    v_cache[0, 0, 0] = cupy.asarray(codes[::-1].copy())
    q = cupy.asarray(numpy.eye(d, dtype=numpy.float32)[None, None]).astype(DTYPES[dtype])   # head h: e_h
    ones = cupy.ones(1, cupy.float32)
    o, lse = cupy_flash.flash_decode(q, k_cache, v_cache, cache_seqlens=cupy.ones(1, cupy.int32), k_descale=ones,
                                     v_descale=ones, softmax_scale=1.0)
    # (lse = max + log(1) in float32: within a rounding of the code's value, far below e4m3's steps)
    assert bool(cupy.allclose(lse[0, :, 0], cupy.asarray(decode_fp8(codes)), rtol=1e-6, atol=0))
    expect = cupy.asarray(decode_fp8(codes[::-1].copy()))
    assert bool((as_float64(o[0, 0]) == expect[None, :]).all())


@requires_gpu
@pytest.mark.parametrize("layout", ["contiguous", "cache_batch_idx", "paged"])
def test_fp8_cache_descales_per_sequence(layout):
    """An FP8 cache whose descales differ per (sequence, K/V head), each sequence's rows quantised by
    its own: the kernel takes sequence b's descale (not its cache row's) for the scores, O and the
    appended rows. Against the reference over the dequantised cache, with the 2x rule."""
    import cupy

    from cupy_flash.fp8 import encode_fp8

    rng = numpy.random.default_rng(12)
    batch, heads_kv, heads, d, capacity, page = 3, 2, 8, 128, 256, 32
    lengths = [100, 0, 254]
    q = random_array(rng, (batch, 1, heads, d), "bfloat16")
    values = [rng.standard_normal((batch, capacity, heads_kv, d)) * numpy.array([1.0, 8.0, 0.1])[:, None, None, None]
              for _ in range(2)]
    descales = [(abs(x).max(axis=(1, 3)) / 448).astype(numpy.float32) for x in values]   # (batch, heads_kv)
    bits = [encode_fp8(x / s.astype(numpy.float64)[:, None, :, None]) for x, s in zip(values, descales)]
    cache = dict(cache_seqlens=cupy.asarray(lengths, dtype=cupy.int32), k_descale=cupy.asarray(descales[0]),
                 v_descale=cupy.asarray(descales[1]))
    cache["k_new"], cache["v_new"] = (random_array(rng, (batch, 1, heads_kv, d), "bfloat16") for _ in range(2))
    filler = encode_fp8(rng.standard_normal((8 * batch, capacity, heads_kv, d)))
    if layout == "contiguous":
        k_cache, v_cache = (cupy.asarray(x) for x in bits)
    elif layout == "cache_batch_idx":
        index = [2, 0, 3]
        pools = [filler[:4].copy() for _ in bits]
        for pool, x in zip(pools, bits):
            pool[index] = x
        k_cache, v_cache = (cupy.asarray(x) for x in pools)
        cache["cache_batch_idx"] = cupy.asarray(index, dtype=cupy.int32)
    else:
        per = capacity // page
        table = rng.permutation(batch * per + 5)[:batch * per].reshape(batch, per).astype(numpy.int32)
        pools = [filler.reshape(-1, page, heads_kv, d)[:batch * per + 5].copy() for _ in bits]
        for pool, x in zip(pools, bits):
            pool[table.reshape(-1)] = x.reshape(-1, page, heads_kv, d)
        k_cache, v_cache = (cupy.asarray(x) for x in pools)
        cache["block_table"] = cupy.asarray(table)
    k_before, v_before = k_cache.copy(), v_cache.copy()
    with poisoned_allocations():
        o, lse = cupy_flash.flash_decode(q, k_cache, v_cache, num_splits=2, **cache)
    exact = decode_reference(q, k_before, v_before, **cache)
    low = decode_reference(q, k_before, v_before, upcast=False, **cache)
    magnitude = max_finite_abs(exact[1])
    check_error_rule("fp8 cache o", o, exact[0], low[0], layout, magnitude)
    check_error_rule("fp8 cache lse", lse, exact[1], low[1], layout, magnitude)
    # The appended rows: each sequence's k_new in its own descale's bits.
    for b, length in enumerate(lengths):
        if layout == "paged":
            at = (int(cache["block_table"][b, length // page]), length % page)
        else:
            at = ([2, 0, 3][b] if layout == "cache_batch_idx" else b, length)
        for name, stored, scales in (("k_new", k_cache, descales[0]), ("v_new", v_cache, descales[1])):
            expect = encode_fp8(as_float64(cache[name][b, 0]) / cupy.asarray(scales[b], dtype=cupy.float64)[:, None])
            assert bool((stored[at] == expect).all()), f"{name} of sequence {b} ({layout})"


# MLA's own kernels (v a view of k, 64 rows a block sharing each key tile): on compute capability
# 9.0 the Hopper kernel for 16-bit and e4m3 caches (decode_sm90.cu), the mma.sync one under the
# "portable" setting. 128 heads in one or two row blocks, a last block part empty (48 and
# 80 rows), pages of 16 (a tile crosses pages), head dims off the tile (520 / 136), splits, appends,
# causal speculative rows. An e4m3 latent cache (saturating descales, per sequence or per head) in
# both dtypes.
MLA_CASES = [
    # dtype, heads, seqlen_q, new, page_size, num_splits, causal, head_dim, head_dim_v, fp8
    ("bfloat16", 128, 1, 1, 64, None, False, 576, 512, None),
    ("float16", 128, 2, 2, None, 3, True, 576, 512, None),
    ("bfloat16", 64, 2, 0, 16, 1, True, 576, 512, None),
    ("float16", 48, 1, 0, 32, None, False, 576, 512, None),
    ("bfloat16", 40, 2, 1, None, 5, True, 576, 512, None),
    ("float16", 64, 1, 1, 16, 2, False, 520, 136, None),
    ("bfloat16", 128, 2, 2, 64, None, True, 576, 512, dict(fit=0.5, per_batch=True)),
    ("float16", 64, 1, 1, None, 3, False, 576, 512, dict(fit=1.0, per_batch=False)),
    ("bfloat16", 40, 2, 0, 16, 1, True, 528, 512, dict(fit=3.0, per_batch=False)),
]


def check_mla_call(p, path: str, monkeypatch):
    """One MLA call (p as make_decode_inputs takes it, v_in_k) under the kernels setting ``path``:
    the kernel dispatch says, v_cache=None giving the same bits, and the error rule."""
    from cupy_flash import decode, families
    from cupy_flash.families import decode as family

    launched = []   # the names of the kernels each new plan launches

    def recording(*args, **kwargs):
        launches = real_launches(*args, **kwargs)
        launched.extend(launch.name for launch in launches)
        return launches

    real_launches = family.decode_launches
    monkeypatch.setattr(family, "decode_launches", recording)
    q, k_cache, v_cache, cache, _ = make_decode_inputs(p)
    k_before, v_before = k_cache.copy(), v_cache.copy()
    decode._plans.clear()
    num_splits, causal = p["num_splits"], p["causal"]
    with families.use_kernels(path):
        with poisoned_allocations():
            o, lse = cupy_flash.flash_decode(q, k_cache, v_cache, num_splits=num_splits, causal=causal, **cache)
        hopper = path != "portable" and families.current_device().compute_capability == 90
        kernel = "flash_mla_decode_sm90_kernel<" if hopper else "flash_mla_decode_kernel<"
        assert any(name.startswith(kernel) for name in launched), (kernel, launched)
        # v_cache=None with head_dim_v (what JAX passes) is the same call, bit for bit, cache included.
        k_after = k_cache.copy()
        copy_bits(k_cache, k_before)
        latent = dict(cache, v_new=None)
        with poisoned_allocations():
            o_latent, lse_latent = cupy_flash.flash_decode(q, k_cache, None, head_dim_v=p["head_dim_v"],
                                                           num_splits=num_splits, causal=causal, **latent)
    for ours, theirs in ((o_latent, o), (lse_latent, lse), (k_cache, k_after)):
        assert bool((bitwise(ours) == bitwise(theirs)).all()), "v_cache=None differs from the view"
    exact = decode_reference(q, k_before, v_before, causal=causal, **cache)
    low = decode_reference(q, k_before, v_before, causal=causal, upcast=False, **cache)
    context = f"{path} {p}"
    magnitude = max_finite_abs(exact[1])
    check_error_rule("mla o", o, exact[0], low[0], context, magnitude)
    check_error_rule("mla lse", lse, exact[1], low[1], context, magnitude)


@requires_gpu
@pytest.mark.parametrize("path", ["auto", "portable"])
@pytest.mark.parametrize("dtype, heads, seqlen_q, new, page_size, num_splits, causal, head_dim, head_dim_v, fp8", MLA_CASES)
def test_mla_kernel_matches_reference(dtype, heads, seqlen_q, new, page_size, num_splits, causal, head_dim, head_dim_v, fp8,
                                      path, monkeypatch):
    capacity = 704
    p = dict(dtype=dtype, batch=3, heads_kv=1, heads=heads, seqlen_q=seqlen_q, new=new, capacity=capacity,
             page_size=page_size, lengths=[capacity - new, 0, 77], head_dim=head_dim, head_dim_v=head_dim_v, v_in_k=True,
             causal=causal, features={}, num_splits=num_splits, logit_std=3.0, seed=heads + seqlen_q, kvcache={}, fp8=fp8)
    check_mla_call(p, path, monkeypatch)


@st.composite
def mla_problems(draw):
    """MLA calls the MLA kernels take: one latent K/V head (q / k head dims 520-576, v's any multiple
    of 8 to 512, a view of k's first columns), 33-128 query rows a token, one or two tokens, lengths
    off every tile (0, 1, a page's edge), pages of 16-256, the splits drawn, extreme logits."""
    seqlen_q = draw(st.integers(1, 2))
    heads = draw(st.one_of(st.just(128), st.integers(33 if seqlen_q == 1 else 17, 128)))
    new = draw(st.integers(0, seqlen_q))
    page_size = draw(st.sampled_from([None, 16, 32, 64, 128, 256]))
    capacity = draw(st.one_of(st.integers(new + 1, 200), st.integers(200, 1500)))
    if page_size:
        capacity = -(-capacity // page_size) * page_size
    batch = draw(st.integers(1, 3))
    lengths = draw(st.lists(st.one_of(st.integers(0, capacity - new), st.sampled_from([0, 1, capacity - new])),
                            min_size=batch, max_size=batch))
    head_dim = draw(st.one_of(st.just(576), st.integers(65, 72).map(lambda n: 8 * n)))
    head_dim_v = draw(st.one_of(st.just(512), st.integers(1, 64).map(lambda n: 8 * n)))
    fp8 = None
    if draw(st.integers(0, 3)) == 0:
        head_dim, head_dim_v = (-(-d // 16) * 16 for d in (head_dim, head_dim_v))
        fp8 = dict(fit=draw(st.sampled_from([0.5, 1.0, 3.0])), per_batch=draw(st.booleans()))
    return dict(dtype=draw(st.sampled_from(["float16", "bfloat16"])), batch=batch, heads_kv=1, heads=heads,
                seqlen_q=seqlen_q, new=new, capacity=capacity, page_size=page_size, lengths=lengths, head_dim=head_dim,
                head_dim_v=head_dim_v, v_in_k=True, causal=draw(st.booleans()), features={},
                num_splits=draw(st.one_of(st.none(), st.integers(1, 9), st.just(64))),
                logit_std=draw(st.sampled_from([0.3, 1.0, 3.0, 30.0])), seed=draw(st.integers(0, 2**32 - 1)),
                kvcache={}, fp8=fp8)


@requires_gpu
@given(mla_problems(), st.sampled_from(["auto", "portable"]))
def test_mla_matches_reference(p, path):
    count_example("mla_matches_reference")
    with pytest.MonkeyPatch.context() as monkeypatch:
        check_mla_call(p, path, monkeypatch)


@requires_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_paged_equals_contiguous_and_splits_agree(dtype):
    """The same cache paged (pages of 16, shuffled) and contiguous gives bitwise the same result
    (same tiles, same order); 1, 3 and 37 splits agree within the error rule."""
    import cupy

    base = dict(dtype=dtype, batch=3, heads_kv=2, heads=16, seqlen_q=2, new=2, capacity=4096, lengths=[4000, 17, 2500],
                head_dim=128, causal=True, features={"softcap": 30.0}, logit_std=3.0, seed=7)
    results = {}
    for page_size in (None, 16):
        for splits in (1, 3, 37):
            p = dict(base, page_size=page_size, num_splits=splits)
            q, k_cache, v_cache, cache, dense = make_decode_inputs(p)
            results[page_size, splits] = cupy_flash.flash_decode(q, k_cache, v_cache, num_splits=splits, **cache,
                                                                 **decode_options(p))
    for splits in (1, 3, 37):
        for a, b in zip(results[None, splits], results[16, splits]):
            assert bool((bitwise(a) == bitwise(b)).all()), f"paged != contiguous at {splits} splits"
    lengths = cupy.asarray(base["lengths"], dtype=cupy.int32) + base["new"]
    q, _, _, cache, (k_dense, v_dense) = make_decode_inputs(dict(base, page_size=None, num_splits=1))
    for b, length in enumerate(base["lengths"]):
        copy_bits(k_dense[b, length:length + 2], cache["k_new"][b])
        copy_bits(v_dense[b, length:length + 2], cache["v_new"][b])
    exact = decode_reference(q, k_dense, v_dense, cache_seqlens=lengths, causal=True, softcap=30.0)
    low = decode_reference(q, k_dense, v_dense, cache_seqlens=lengths, causal=True, softcap=30.0, upcast=False)
    for splits in (1, 3, 37):
        check_error_rule("decode o", results[None, splits][0], exact[0], low[0], f"splits={splits}")
        check_error_rule("decode lse", results[None, splits][1], exact[1], low[1], f"splits={splits}", max_finite_abs(exact[1]))


@requires_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("seqlen_q, seqlen_k, heads, heads_kv", [(1, 40000, 16, 2), (4, 3000, 8, 8), (1, 1, 4, 1), (3, 130, 6, 3)])
def test_forward_split_path(dtype, seqlen_q, seqlen_k, heads, heads_kv):
    """flash_forward's split-KV path (few queries, many keys), chosen automatically and forced."""
    rng = numpy.random.default_rng(3)
    q = random_array(rng, (2, seqlen_q, heads, 64), dtype)
    k, v = (random_array(rng, (2, seqlen_k, heads_kv, 64), dtype) for _ in range(2))
    exact = attention_reference(q, k, v, causal=True)
    low = attention_reference(q, k, v, causal=True, upcast=False)
    for splits in (None, 1, 5):
        with poisoned_allocations():
            o, lse = cupy_flash.flash_forward(q, k, v, causal=True, num_splits=splits)
        check_error_rule("o", o, exact[0], low[0], f"splits={splits}")
        check_error_rule("lse", lse, exact[1], low[1], f"splits={splits}", max_finite_abs(exact[1]))


# ---------------------------------------------------------------------------------------------
# merge_attention_states (GPU).

@requires_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_merge_equals_attention_over_the_union(dtype):
    """Keys split into disjoint sets (one of them empty for some rows through a window, one wholly
    empty): merging each set's (o, lse) gives attention over all keys."""
    import cupy

    rng = numpy.random.default_rng(11)
    batch, seqlen_q, heads, d, seqlen_k = 2, 5, 3, 40, 300
    q = random_array(rng, (batch, seqlen_q, heads, d), dtype, 1.5)
    k = random_array(rng, (batch, seqlen_k, heads, d), dtype, 1.5)
    v = random_array(rng, (batch, seqlen_k, heads, d), dtype)
    cuts = [0, 0, 97, 98, 250, 300]   # sets [0, 0) (empty), [0, 97), [97, 98), [98, 250), [250, 300)
    outputs, lses = [], []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        if hi == lo:   # an empty key set: o = 0, lse = -inf
            outputs.append(cupy.zeros(q.shape, {2: cupy.uint16, 4: cupy.float32}[q.dtype.itemsize]).view(q.dtype))
            lses.append(cupy.full((batch, heads, seqlen_q), -numpy.inf, cupy.float32))
            continue
        o, lse = cupy_flash.flash_forward(q, k[:, lo:hi], v[:, lo:hi])
        outputs.append(o)
        lses.append(lse)
    with poisoned_allocations():
        merged, merged_lse = cupy_flash.merge_attention_states(outputs, lses)
    exact = attention_reference(q, k, v)
    low = attention_reference(q, k, v, upcast=False)
    # Each partial was rounded to the dtype once before the merge, as a dense reference's o is.
    check_error_rule("merge o", merged, exact[0], low[0], dtype)
    check_error_rule("merge lse", merged_lse, exact[1], low[1], dtype, max_finite_abs(exact[1]))


@requires_gpu
@pytest.mark.parametrize("dtype, head_dim, count", [("float32", 7, 130), ("float16", 200, 37), ("bfloat16", 64, 3),
                                                     ("bfloat16", 510, 5)])
def test_merge_many_partials(dtype, head_dim, count):
    """Many partials (more than one round of the combine's warps, past 128), head dims off the
    vector path (7), past one pass of columns (200) and in the wide combine's fourth 128-column
    slice (510: a block per slice of a row, the last one short); an empty set's O is NaN and must
    weigh 0."""
    import cupy

    from cupy_flash.reference import round_to_dtype

    rng = numpy.random.default_rng(count)
    batch, seqlen_q, heads = 1, 3, 2
    seqlen_k = 2 * count
    q = random_array(rng, (batch, seqlen_q, heads, head_dim), dtype, 1.5)
    k = random_array(rng, (batch, seqlen_k, heads, head_dim), dtype, 1.5)
    v = random_array(rng, (batch, seqlen_k, heads, head_dim), dtype)
    cuts = numpy.concatenate([[0, 0], numpy.sort(rng.choice(numpy.arange(1, seqlen_k), count - 2, replace=False)), [seqlen_k]])
    outputs, lses = [], []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        if hi == lo:
            outputs.append(cupy.full(q.shape, numpy.nan, cupy.float32).astype(q.dtype))
            lses.append(cupy.full((batch, heads, seqlen_q), -numpy.inf, cupy.float32))
            continue
        o, lse = attention_reference(q, k[:, lo:hi], v[:, lo:hi])
        outputs.append(cupy.asarray(round_to_dtype(o, q.dtype, cupy)).astype(q.dtype))
        lses.append(lse.astype(cupy.float32))
    assert len(outputs) == count
    with poisoned_allocations():
        merged, merged_lse = cupy_flash.merge_attention_states(outputs, lses)
    exact = attention_reference(q, k, v)
    low = attention_reference(q, k, v, upcast=False)
    check_error_rule("merge o", merged, exact[0], low[0], f"{dtype} d={head_dim} count={count}")
    check_error_rule("merge lse", merged_lse, exact[1], low[1], dtype, max_finite_abs(exact[1]))


@requires_gpu
def test_merge_rows_no_partial_saw():
    import cupy

    o = cupy.full((1, 2, 1, 8), 3.0, cupy.float32)
    lse = cupy.asarray([[[-numpy.inf, 0.5]]], dtype=cupy.float32)
    merged, merged_lse = cupy_flash.merge_attention_states([o, o], [lse, lse])
    assert not bool(cupy.isnan(merged).any())
    assert bool((merged[0, 0] == 0).all()) and float(merged_lse[0, 0, 0]) == -numpy.inf
    assert bool(cupy.allclose(merged[0, 1], 3.0)) and abs(float(merged_lse[0, 0, 1]) - (0.5 + numpy.log(2))) < 1e-6


# ---------------------------------------------------------------------------------------------
# CUDA graphs.

@requires_gpu
def test_chained_calls_with_early_launches(monkeypatch):
    """Each call's queries are the previous call's output; every other call also appends a row made
    from them (k_new, v_new), after a kernel has advanced cache_seqlens. The calls run back to back
    (queued behind a long matmul, and captured in a graph). On sm_90 the append, decode and combine
    kernels are launched early (_launch.py): a call's decode kernel becomes resident, and prefetches
    its keys into L2, while the previous call's combine still writes the o it reads, or while the
    append still writes the rows it reads (and the pool hands it the previous call's partials'
    memory). The chain equals one of ordinary launches bit for bit, and the rows appended matter."""
    import cupy

    from cupy_flash import _launch

    rng = numpy.random.default_rng(3)
    batch, heads, heads_kv, head_dim, capacity, calls = 1, 32, 4, 128, 4096, 12
    k_start = random_array(rng, (batch, capacity, heads_kv, head_dim), "bfloat16")
    v_start = random_array(rng, (batch, capacity, heads_kv, head_dim), "bfloat16", magnitude=4.0)
    length_start = capacity - 5 - calls
    first = random_array(rng, (batch, 1, heads, head_dim), "bfloat16", magnitude=3.0)
    k_cache, v_cache = cupy.empty_like(k_start), cupy.empty_like(v_start)
    lengths = cupy.empty((batch,), dtype=cupy.int32)
    busy = cupy.ones((8192, 8192), dtype=cupy.float32)

    def reset():
        k_cache.view(cupy.uint16)[...] = k_start.view(cupy.uint16)
        v_cache.view(cupy.uint16)[...] = v_start.view(cupy.uint16)
        lengths.fill(length_start)

    def chain(q, append=True):
        outputs = []
        for i in range(calls):
            new = {}
            if append and i % 2:
                lengths[...] += 1   # the row appended by the call before is now in the cache
                row = cupy.ascontiguousarray(q[:, :, :heads_kv])
                new = dict(k_new=row, v_new=row)
            q, lse = cupy_flash.flash_decode(q, k_cache, v_cache, cache_seqlens=lengths, **new)
            outputs += [q, lse]
        return outputs

    early = []
    launch_ex = _launch._launch_ex
    monkeypatch.setattr(_launch, "_launch_ex", lambda *args: early.append(launch_ex(*args)) or early[-1])
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        reset()
        chain(first)   # compile, warm the pool
        reset()
        busy @ busy    # keeps the GPU busy while the chain is queued behind it
        queued = chain(first)
        stream.begin_capture()
        captured = chain(first)
        graph = stream.end_capture()
        reset()
        graph.launch()
        stream.synchronize()
    if int(cupy.cuda.Device().compute_capability) >= 90:
        assert early and all(result == 0 for result in early), f"early launches refused: {early}"
    monkeypatch.setenv("CUPY_FLASH_PDL", "0")
    count = len(early)
    reset()
    ordinary = chain(first)
    reset()
    unappended = chain(first, append=False)
    cupy.cuda.Device().synchronize()
    assert len(early) == count
    assert not bool((bitwise(unappended[-2]) == bitwise(ordinary[-2])).all()), "the appended rows did not matter"
    for i, expected in enumerate(ordinary):
        assert bool((bitwise(queued[i]) == bitwise(expected)).all()), f"queued call {i // 2}: {('o', 'lse')[i % 2]}"
        assert bool((bitwise(captured[i]) == bitwise(expected)).all()), f"graph call {i // 2}: {('o', 'lse')[i % 2]}"


@requires_gpu
@pytest.mark.parametrize("num_splits", [None, 5, 1])
def test_decode_graph_replay_matches_eager(num_splits):
    """flash_decode captured once in a CUDA graph (fixed shapes, device-side cache_seqlens) and
    replayed while cache_seqlens and k_new/v_new change, as a generation loop does, gives what eager
    calls give (split automatically, in 5, and unsplit)."""

    p = dict(dtype="bfloat16", batch=2, heads_kv=2, heads=8, seqlen_q=1, new=1, capacity=1024, page_size=64,
             lengths=[100, 500], head_dim=128, causal=True, features={}, num_splits=num_splits, logit_std=1.0, seed=5)
    q, k_cache, v_cache, cache, _ = make_decode_inputs(p)
    cache["num_splits"] = num_splits
    check_graph_replay_equals_eager(q, (k_cache, v_cache), (k_cache.copy(), v_cache.copy()),
                                    (k_cache.copy(), v_cache.copy()), cache, [cache["k_new"], cache["v_new"], q],
                                    numpy.random.default_rng(0))


def check_graph_replay_equals_eager(q, caches, eager_caches, warm_caches, cache, refreshed, rng):
    """flash_decode(q, *caches, **cache) captured once in a CUDA graph (after a call on warm_caches:
    compile, warm the pool) and replayed three times while the arrays of ``refreshed`` take new
    bf16 values and cache_seqlens advances on the device, as a generation loop does: each step's o,
    lse and caches bitwise equal to an eager call's on eager_caches (copies of caches as they were)."""
    import cupy

    stream = cupy.cuda.Stream()
    with stream:   # everything on one stream: its order is the only synchronisation needed
        cupy_flash.flash_decode(q, *warm_caches, **cache)
        stream.synchronize()
        stream.begin_capture()
        o_graph, lse_graph = cupy_flash.flash_decode(q, *caches, **cache)
        graph = stream.end_capture()
        for step in range(3):
            for x in refreshed:
                copy_bits(x, random_array(rng, x.shape, "bfloat16"))
            graph.launch()
            o_eager, lse_eager = cupy_flash.flash_decode(q, *eager_caches, **cache)
            stream.synchronize()
            assert bool((bitwise(o_graph) == bitwise(o_eager)).all()), f"step {step}: o"
            assert bool((bitwise(lse_graph) == bitwise(lse_eager)).all()), f"step {step}: lse"
            for name, x, y in zip(("k_cache", "v_cache"), caches, eager_caches):
                assert bool((bitwise(x) == bitwise(y)).all()), f"step {step}: {name}"
            cache["cache_seqlens"] += 1   # the loop advances the lengths on the device


@requires_gpu
@pytest.mark.parametrize("fp8", [None, dict(fit=1.0, per_batch=True)])
def test_mla_graph_replay_matches_eager_and_views_keep_their_own_plans(fp8):
    """The MLA kernel (v a view of k) captured in a CUDA graph and replayed while the lengths, q and
    the new rows change gives what eager calls give, bitwise (bf16 and e4m3 caches); and a call whose
    v has the same shape and strides but is a view of another array does not take the MLA plan."""

    p = dict(dtype="bfloat16", batch=2, heads_kv=1, heads=64, seqlen_q=1, new=1, capacity=512, page_size=64,
             lengths=[100, 300], head_dim=576, head_dim_v=512, v_in_k=True, causal=False, features={}, num_splits=None,
             logit_std=1.0, seed=6, kvcache={}, fp8=fp8)
    q, k_cache, v_cache, cache, _ = make_decode_inputs(p)
    k_eager, warm = k_cache.copy(), k_cache.copy()   # with v their views, as the MLA kernel takes them
    rng = numpy.random.default_rng(1)
    check_graph_replay_equals_eager(q, (k_cache, v_cache), (k_eager, k_eager[..., :512]), (warm, warm[..., :512]), cache,
                                    [cache["k_new"], q], rng)   # (v_new: k_new's view)
    # v of the same shape and strides, a view of another array: the general kernel, against the reference.
    other = random_array(rng, k_cache.shape, "bfloat16") if fp8 is None else k_cache.copy()[..., ::-1].copy()
    v_other = other[..., :512]
    assert v_other.strides == v_cache.strides and v_other.shape == v_cache.shape
    del cache["k_new"], cache["v_new"]
    k_before, v_before = k_cache.copy(), v_other.copy()
    o, lse = cupy_flash.flash_decode(q, k_cache, v_other, **cache)
    exact = decode_reference(q, k_before, v_before, **cache)
    low = decode_reference(q, k_before, v_before, upcast=False, **cache)
    magnitude = max_finite_abs(exact[1])
    check_error_rule("mla view of another array o", o, exact[0], low[0], str(fp8), magnitude)
    check_error_rule("mla view of another array lse", lse, exact[1], low[1], str(fp8), magnitude)


@requires_gpu
def test_cache_batch_idx_outside_the_cache_sees_no_key():
    """A cache_batch_idx row outside the cache: that sequence sees no key (o = 0, lse = -inf) and its
    new rows are written nowhere; the other sequence is as the reference has it."""
    import cupy

    rng = numpy.random.default_rng(11)
    q = random_array(rng, (2, 1, 4, 64), "bfloat16")
    pool = random_array(rng, (2, 128, 2, 64), "bfloat16")
    new = random_array(rng, (2, 1, 2, 64), "bfloat16")
    before = pool.copy()
    lengths = cupy.asarray([50, 20], dtype=cupy.int32)
    index = cupy.asarray([5, 0], dtype=cupy.int32)
    o, lse = cupy_flash.flash_decode(q, pool, pool, cache_seqlens=lengths, k_new=new, v_new=new, cache_batch_idx=index)
    assert bool((o[0].astype(cupy.float32) == 0).all()) and bool(cupy.isneginf(lse[0]).all())
    assert bool((bitwise(pool[0, 20]) == bitwise(new[1, 0])).all())   # cache row 0 took sequence 1's token ...
    expect = before.copy()
    expect[0, 20] = pool[0, 20]
    assert bool((bitwise(pool) == bitwise(expect)).all())             # ... and nothing else changed
    exact = decode_reference(q[1:], before, before, cache_seqlens=lengths[1:], k_new=new[1:], v_new=new[1:],
                             cache_batch_idx=index[1:])
    low = decode_reference(q[1:], before, before, cache_seqlens=lengths[1:], k_new=new[1:], v_new=new[1:],
                           cache_batch_idx=index[1:], upcast=False)
    check_error_rule("decode o", o[1:], exact[0], low[0], "index outside the cache", max_finite_abs(exact[1]))
