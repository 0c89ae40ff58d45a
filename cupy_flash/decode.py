"""Decoding launch (decode.cu): split-KV attention for few queries over many keys, ``flash_decode``
against a (paged) K/V cache, and ``merge_attention_states``."""

from __future__ import annotations

import ctypes
import dataclasses
import math
import numbers

import numpy

from . import _checks, _launch, _tma, _traits
from ._compile import TENSOR_CORE_DTYPES
from ._features import DECODE_FEATURES, check_variant
from ._params import PointerRecord, as_argument, make_params
from ._streams import STREAM_DOC, on_stream, record_kernel_arrays
from .families import decode as family
from .families import device_info, kernels_setting

# A split covers at least this many keys: below it the partials' write and combine cost more than
# the parallelism gains. num_splits= takes up to MAX_SPLITS; the automatic choice stops at
# MAX_AUTO_SPLITS. On the H100 (bf16, graphs of decode calls, one token, 32 query heads) one query
# head per K/V head at 32k keys ran at 892 GB/s with 64 splits (a block on 128 SMs) against 757
# with 32 and 734 with 128; two K/V heads of 16: 1451 with 64, 1506 with 32, 1260 with 128.
MIN_KEYS_PER_SPLIT = 128
# The MLA kernel's blocks do 64 rows x (576 + 512) columns of products a key: half the keys a split
# still pay for themselves, and batch 1 at 4k keys then fills the SMs (128 blocks, not 64).
MLA_MIN_KEYS_PER_SPLIT = 64
# The Hopper MLA kernel (decode_sm90.cu) at most MLA_SM90_SPLITS splits, or one per
# MLA_SM90_KEYS_PER_SPLIT keys where that is more: its blocks finish a tile in about a third of the
# mma.sync kernel's time, so the combine of the splits' partials (splits x rows x 512 float32
# columns) and each block's start weigh more (docs/decisions.md, Decoding: "MLA splits on the
# Hopper kernel").
MLA_SM90_SPLITS = 32
MLA_SM90_KEYS_PER_SPLIT = 1024
MAX_AUTO_SPLITS = 64
MAX_SPLITS = 128

# flash_forward takes the decode kernel when a K/V head's query rows (group x seqlen_q) fit in this
# many 16-row blocks: the regular forward's 128-row blocks would be mostly padding.
DECODE_MAX_ROWS = 32


def choose_splits(work_units: int, keys: int, tile: int, device: int, fp8_cache: bool = False,
                  min_keys: int = MIN_KEYS_PER_SPLIT) -> int:
    """Splits of the keys over ``work_units`` blocks (batch x K/V heads x row blocks): while the
    work fits on the SMs, as many as keep one block per SM; past that, about one wave of the
    blocks each SM holds (_traits.decode_blocks_per_sm). Each split keeps MIN_KEYS_PER_SPLIT keys
    or more (``min_keys``), at most MAX_AUTO_SPLITS.

    One block per SM, measured on the H100 (bf16, graphs of decode calls at 32k keys, one token,
    32 query heads, early launches): 1:1 at batch 1 (32 units) 2796 GB/s with 4 splits against
    2737 with 8 and 2708 with 13 (the old choice: three blocks per SM); batch 2 (64 units) 2881
    with 2 splits against 2583 with 7; 96 units 2850 unsplit against 2710 with 5; head_dim 256,
    32 units: 2866 with 4 against 2303 with 5 (160 blocks, one per SM: two waves). Past the SMs,
    192 units: 2855 with 2 splits, 2806 with 3, 2687 unsplit."""
    sms = device_info(device).multiprocessors
    if work_units <= sms:
        wanted = sms // work_units
    else:
        wanted = sms * _traits.decode_blocks_per_sm(tile, fp8_cache) // work_units
    # Past one pass of the combine's warps, whole passes only: 33 splits (all 132 SMs) ran slower
    # than 32 (2001 against 2041 GB/s, GQA 8:1 batch 1 at 32k keys).
    combine_pass = _traits.COMBINE_BATCH * _traits.COMBINE_MAX_WARPS
    if wanted > combine_pass:
        wanted -= wanted % combine_pass
    return max(1, min(wanted, keys // min_keys, MAX_AUTO_SPLITS))


def _split_layout(num_splits: int, keys: int) -> tuple[int, int]:
    """(splits, keys per split): whole chunks of the block's warps per split, no empty split."""
    per_split = -(-keys // num_splits)
    chunk = _traits.DECODE_KEYS_PER_CHUNK
    per_split = max(chunk, -(-per_split // chunk) * chunk)
    return -(-keys // per_split), per_split


def check_num_splits(num_splits) -> int | None:
    if num_splits is None:
        return None
    if isinstance(num_splits, (bool, numpy.bool_)) or not isinstance(num_splits, numbers.Integral):
        raise TypeError(f"num_splits must be an int or None, got {type(num_splits).__name__}")
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits is {int(num_splits)}; expected 1 to {MAX_SPLITS}")
    return int(num_splits)


def uses_split_path(shape, variant, num_splits) -> bool:
    """Whether flash_forward runs on the decode kernel: fp16/bf16, few query rows per K/V head (or
    num_splits given), and no bias or packed batch (the decode kernel has neither)."""
    if shape.dtype not in TENSOR_CORE_DTYPES or variant.flags & ~DECODE_FEATURES:
        return False
    return num_splits is not None or shape.group * shape.seqlen_q <= DECODE_MAX_ROWS


class DecodePlan(_launch.OutputAndLse):
    """A decode call's launches with everything but the arrays' addresses (as forward.ForwardPlan):
    the append kernel where new rows come, the decode kernel, and the combine kernel where the keys
    are split (its partials in one workspace); the params record with each array's field written
    per call. flash_decode keeps the plans of its calls without ALiBi or a sink (_plans)."""

    def __init__(self, record, launches: tuple, o, lse_shape: tuple, partials: tuple, held: tuple, plain: bool,
                 k_map=None):
        self.cuda = _launch.cuda_calls()
        self.record = record              # a PointerRecord over _NAMES
        self.device = self.cuda.get_device()
        early = _launch.supports_early(self.device)
        self.launches = tuple(launch._replace(early=launch.early and early) for launch in launches)   # _launch.Launch
        self.plan_outputs(o, lse_shape)
        # o_partial and lse_partial in one workspace (empty when the keys are not split): lse_partial
        # at this offset
        offsets, self.workspace_bytes = _launch.aligned_offsets(partials)
        self.lse_partial_offset = offsets[1] if partials else 0
        self.held = held                  # the variant's device arrays the record points at
        # Only q, the caches and cache_seqlens (no block table, new rows or descales): the short
        # path's addresses without a look at the rest.
        self.plain = plain
        self._launched: dict = {}         # Packed by the arrays' addresses, stream and thread
        # The Hopper MLA kernel's k tensor map: (dtype, keys a box, k's layout), encoded per k address
        # (families/decode.py, mla_sm90_box_keys); None where no launch takes one.
        self.k_map = k_map
        self._k_maps: dict = {}

    def call(self, q, k, v, cache_seqlens, block_table, k_new, v_new, k_descale, v_descale):
        """The repeated call (flash_decode's plan cache found this plan: the arrays are as the plan's,
        and the kvcache index options absent): (o, lse), or None where the plan cannot launch as it
        is (another current device, a capturing stream). Its addresses are run's, in _NAMES' order."""
        stream = _launch.ready_stream(self)
        if stream is None:
            return None
        o, lse = self.outputs()
        if self.plain:
            addresses = (q.data.ptr, k.data.ptr, v.data.ptr, cache_seqlens.data.ptr, 0, 0, 0, 0, 0, 0, 0, o.data.ptr,
                         lse.data.ptr)
        else:
            addresses = (q.data.ptr, k.data.ptr, v.data.ptr, cache_seqlens.data.ptr, _address(block_table),
                         _address(k_new), _address(v_new), 0, 0, _address(k_descale), _address(v_descale), o.data.ptr,
                         lse.data.ptr)
        workspace = None
        if self.workspace_bytes:
            workspace, base = self._workspace(stream, False)
            addresses += (base, base + self.lse_partial_offset)
        _launch.packed_once(self._launched, addresses, stream, False, lambda: self._packed(addresses, stream)).run()
        return o, lse

    def _workspace(self, stream: int, capturing: bool) -> tuple:
        """(what holds the partials' workspace until the launches are out, its address): the stream's
        kept one (the kernels wait for the previous call's), or under capture or past
        KEPT_WORKSPACE_BYTES a new allocation."""
        if capturing or self.workspace_bytes > _launch.KEPT_WORKSPACE_BYTES:
            workspace = self.cuda.alloc(self.workspace_bytes)
            return workspace, workspace.ptr
        workspace = _launch.kept_workspace(self.workspace_bytes, self.device, stream)
        return workspace, workspace.data.ptr

    def run(self, arrays: tuple, out=None):
        """Launch on the current stream (``arrays``: q, k, v, cache_seqlens, block_table, k_new, v_new,
        cache_batch_idx, cache_leftpad, k_descale, v_descale, None where absent; ``out``: (o, lse) to
        write, else allocated); returns (o, lse)."""
        stream, capturing = _launch.current_stream()
        return self._run(arrays, out, stream, capturing)

    def _run(self, arrays: tuple, out, stream: int, capturing: bool):
        o, lse = self.outputs() if out is None else out
        addresses = tuple([0 if x is None else x.data.ptr for x in arrays] + [o.data.ptr, lse.data.ptr])
        workspace = None
        if self.workspace_bytes:
            workspace, base = self._workspace(stream, capturing)
            addresses += (base, base + self.lse_partial_offset)
        if capturing:
            record_kernel_arrays(arrays + (o, lse, workspace) + self.held)
        _launch.packed_once(self._launched, addresses, stream, capturing, lambda: self._packed(addresses, stream)).run()
        return o, lse

    def _packed(self, addresses: tuple, stream: int) -> _launch.Packed:
        record = self.record.filled(dict(zip(_NAMES, addresses)))
        k_map = None
        if self.k_map is not None:
            dtype, box_keys, layout = self.k_map
            k_at = addresses[1]
            # 64 columns a box: 128 swizzled bytes of a 16-bit cache, 64 raw bytes of an FP8 one
            # (decode_sm90.cu expands those itself).
            fp8 = dtype == "uint8"
            k_map = ctypes.create_string_buffer(_launch.cached(self._k_maps, k_at, lambda: _tma.attention_map_at(
                k_at, layout, dtype, box_keys, packed=False, row_bytes=_tma.SWIZZLE_BYTES // (2 if fp8 else 1),
                swizzled=not fp8)), _tma.MAP_BYTES)
        return _launch.Packed(tuple((launch.kernel, launch.grid, launch.threads, launch.smem,
                                     (record,) if launch.maps is None else (k_map, record), launch.early)
                                    for launch in self.launches), stream,
                              ("decode", tuple(launch.name for launch in self.launches)))


def _address(x) -> int:
    return 0 if x is None else x.data.ptr


# A decode launch's arrays, in the order of its addresses (k and v: the caches).
_NAMES = ("q", "k", "v", "cache_seqlens", "block_table", "k_new", "v_new", "cache_batch_idx", "cache_leftpad", "k_descale",
          "v_descale", "o", "lse", "o_partial", "lse_partial")


def decode_plan(q, k, v, shape, scale, variant, num_splits=None, *, cache=None) -> DecodePlan:
    """The plan of a checked decode call (or flash_forward's split path): ``shape.seqlen_k`` is the
    cache capacity; ``cache`` (flash_decode) holds cache_seqlens, block_table, page_shift, k_new,
    v_new, cache_batch_idx, cache_leftpad, k_descale, v_descale."""
    import cupy

    device = q.device.id
    # MLA's latent cache (v a view of k's first columns): its own kernel where it takes the call.
    v_in_k = cache is not None and v.data.ptr == k.data.ptr and tuple(v.strides) == tuple(k.strides)
    info = device_info(device)
    mla = family.uses_mla_kernel(info, shape, variant, v_in_k)
    mla_sm90 = mla and family.uses_mla_sm90(info, shape, variant, _tma.maps_supported(k))
    rows = shape.group * shape.seqlen_q
    if mla:
        work_units = shape.batch * shape.heads_kv * -(-rows // _traits.MLA_DECODE_ROWS)
    else:   # blocks before the split (v's columns over v_split blocks above the wide tile: decode.cu)
        work_units = shape.batch * shape.heads_kv * -(-rows // _traits.DECODE_ROWS) * _traits.v_split(shape.tile)
    if num_splits is None:
        num_splits = choose_splits(work_units, shape.seqlen_k, shape.tile, device, variant.fp8_cache,
                                   MLA_MIN_KEYS_PER_SPLIT if mla else MIN_KEYS_PER_SPLIT)
        if mla_sm90:
            num_splits = min(num_splits, max(MLA_SM90_SPLITS, shape.seqlen_k // MLA_SM90_KEYS_PER_SPLIT))
    num_splits, keys_per_split = _split_layout(num_splits, shape.seqlen_k)
    grid = num_splits * work_units
    if grid > _checks.MAX_GRID_BLOCKS:
        raise ValueError(f"batch * heads_kv * row blocks * splits (* v splits) is {grid}, over CUDA's grid limit")
    lse_shape = (shape.batch, shape.heads, shape.seqlen_q)
    # The record is filled from stand-ins (make_params reads addresses and strides; the plan
    # writes each call's addresses).
    o_shape = tuple(q.shape[:-1]) + (shape.head_dim_v,)
    arrays = dict(q=q, k=k, v=v, o=cupy.ndarray(o_shape, q.dtype, q.data), lse=cupy.ndarray(lse_shape, numpy.float32, q.data))
    partials = ()
    if num_splits > 1:
        # Partials: normalised O per split (float32) and its lse; O(splits x outputs), never seqlen^2.
        partial_shapes = ((num_splits, shape.batch, shape.seqlen_q, shape.heads, shape.head_dim_v),
                          (num_splits, shape.batch, shape.heads, shape.seqlen_q))
        arrays["o_partial"], arrays["lse_partial"] = (cupy.ndarray(s, numpy.float32, q.data) for s in partial_shapes)
        partials = tuple(4 * math.prod(s) for s in partial_shapes)
    if cache is not None:
        arrays.update(cache_seqlens=cache["cache_seqlens"], block_table=cache.get("block_table"),
                      k_new=cache.get("k_new"), v_new=cache.get("v_new"), cache_batch_idx=cache.get("cache_batch_idx"),
                      cache_leftpad=cache.get("cache_leftpad"), k_descale=cache.get("k_descale"),
                      v_descale=cache.get("v_descale"))
    params = make_params(shape, scale, variant=variant, **arrays)
    params["num_splits"] = num_splits
    params["keys_per_split"] = keys_per_split
    params["cache_capacity"] = shape.seqlen_k
    if cache is not None:
        params["seqlen_new"] = 0 if cache.get("k_new") is None else cache["k_new"].shape[1]
        if cache.get("block_table") is not None:
            params["block_table_stride"] = cache["block_table"].shape[1]
            params["page_shift"] = cache["page_shift"]
        params["cache_batch"] = k.shape[0]
    new_rows = 0 if cache is None or cache.get("k_new") is None else int(cache["k_new"].shape[1])
    launches = family.decode_launches(info, shape, variant, grid, num_splits, new_rows, mla, mla_sm90)
    k_map = None
    if mla_sm90:
        page_size = None if cache.get("block_table") is None else 1 << cache["page_shift"]
        k_map = ("uint8" if variant.fp8_cache else shape.dtype, family.mla_sm90_box_keys(page_size), _tma.layout_of(k))
    record = PointerRecord(params, {name: name for name in _NAMES if name in arrays and arrays[name] is not None})
    held = tuple(x for x in variant.device_arrays() if x is not None)
    plain = all(arrays.get(name) is None for name in ("block_table", "k_new", "v_new", "k_descale", "v_descale"))
    return DecodePlan(record, tuple(launches), arrays["o"], lse_shape, partials, held, plain, k_map)


def launch_decode(q, k, v, shape, scale, variant, num_splits=None, *, cache=None, out=None):
    """o, lse of the decode kernel (with its combine when split), as decode_plan plans it; ``out``:
    (o, lse) to write, checked by forward.check_outputs (else allocated)."""
    variant = variant.on_device()
    plan = decode_plan(q, k, v, shape, scale, variant, num_splits, cache=cache)
    cache = cache or {}
    return plan.run((q, k, v, cache.get("cache_seqlens"), cache.get("block_table"), cache.get("k_new"),
                     cache.get("v_new"), cache.get("cache_batch_idx"), cache.get("cache_leftpad"), cache.get("k_descale"),
                     cache.get("v_descale")), out)


# ---------------------------------------------------------------------------------------------
# flash_decode

def check_decode(q, k_cache, v_cache, cache_seqlens, k_new=None, v_new=None, block_table=None, cache_batch_idx=None,
                 cache_leftpad=None, k_descale=None, v_descale=None):
    """Shapes of a decode call (reads .shape/.dtype/.ndim only): (AttentionShape with seqlen_k =
    the cache capacity, page_shift or None). An FP8 cache: k_cache and v_cache uint8 (e4m3 bits)
    with k_descale and v_descale (check_fp8_cache)."""
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(f"{name} must have 4 dimensions, got shape {tuple(getattr(x, 'shape', ()))}")
    kind = _checks.dtype_name(q.dtype)
    if kind not in TENSOR_CORE_DTYPES:
        raise TypeError(f"q has dtype {q.dtype}; flash_decode takes float16 or bfloat16")
    fp8_cache = check_fp8_cache(k_cache, v_cache, k_descale, v_descale)
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if x.dtype != q.dtype and not fp8_cache:
            raise TypeError(f"{name} has dtype {x.dtype} but q has dtype {q.dtype}")
    if tuple(v_cache.shape[:3]) != tuple(k_cache.shape[:3]):
        raise ValueError(f"v_cache has shape {tuple(v_cache.shape)} but k_cache has shape {tuple(k_cache.shape)}; "
                         "they must match but in the head_dim (v's may differ: o takes it)")
    batch, seqlen_q, heads, head_dim = (int(n) for n in q.shape)
    head_dim_v = int(v_cache.shape[3])
    # q and k to DECODE_MAX_HEAD_DIM (MLA's 576), v (and o) to MAX_HEAD_DIM.
    for name, d, most in (("q", head_dim, _traits.DECODE_MAX_HEAD_DIM), ("v_cache", head_dim_v, _traits.MAX_HEAD_DIM)):
        if d % 8 or not 8 <= d <= most:
            raise ValueError(f"{name} has head_dim {d}; expected a multiple of 8 from 8 to {most}")
    if int(k_cache.shape[3]) != head_dim:
        raise ValueError(f"k_cache has head_dim {k_cache.shape[3]} but q has head_dim {head_dim}")
    if fp8_cache:
        for name, d in (("k_cache", head_dim), ("v_cache", head_dim_v)):
            if d % 16:
                raise ValueError(f"{name} has head_dim {d}; an FP8 cache's rows are read in 16-byte units (a "
                                 "multiple of 16)")
    heads_kv = int(k_cache.shape[2])
    if heads_kv < 1 or heads % heads_kv:
        raise ValueError(f"k_cache has {heads_kv} heads but q has {heads}; the query heads must be a multiple "
                         "of the K/V heads")
    if batch < 1 or seqlen_q < 1 or heads < 1:
        raise ValueError(f"q has shape {tuple(q.shape)}; every dimension must be at least 1")
    _checks.check_index_array("cache_seqlens", cache_seqlens, (batch,), "(batch,)")
    for name, x in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
        if x is not None:
            _checks.check_index_array(name, x, (batch,), "(batch,)")
    if cache_batch_idx is not None and block_table is not None:
        raise ValueError("cache_batch_idx is not supported with block_table: a paged cache names each sequence's "
                         "pages in block_table already")
    page_shift = None
    if block_table is not None:
        page_shift, capacity = _checks.check_block_table(block_table, k_cache, batch)
    else:
        if int(k_cache.shape[0]) != batch and cache_batch_idx is None:
            raise ValueError(f"k_cache has batch {k_cache.shape[0]} but q has batch {batch} (without block_table "
                             "or cache_batch_idx the cache is (batch, capacity, heads_kv, head_dim))")
        if int(k_cache.shape[0]) < 1:
            raise ValueError(f"k_cache has shape {tuple(k_cache.shape)}; it needs at least one sequence")
        capacity = int(k_cache.shape[1])
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new come together: pass both or neither")
    if k_new is not None:
        for name, x in (("k_new", k_new), ("v_new", v_new)):
            if getattr(x, "ndim", None) != 4:
                raise ValueError(f"{name} must have 4 dimensions (batch, seqlen_new, heads_kv, head_dim), "
                                 f"got shape {tuple(getattr(x, 'shape', ()))}")
            if x.dtype != q.dtype:
                raise TypeError(f"{name} has dtype {x.dtype} but q has dtype {q.dtype}")
            d = head_dim if name == "k_new" else head_dim_v
            if (int(x.shape[0]), int(x.shape[2]), int(x.shape[3])) != (batch, heads_kv, d):
                raise ValueError(f"{name} has shape {tuple(x.shape)}; expected (batch, seqlen_new, heads_kv, "
                                 f"head_dim) = ({batch}, *, {heads_kv}, {d})")
        if tuple(v_new.shape[:3]) != tuple(k_new.shape[:3]):
            raise ValueError(f"v_new has shape {tuple(v_new.shape)} but k_new has shape {tuple(k_new.shape)}")
        if int(k_new.shape[1]) < 1:
            raise ValueError("k_new has no rows; pass k_new=None to append nothing")
    if capacity >= _checks.MAX_SEQLEN:
        raise ValueError(f"the cache holds {capacity} keys per sequence; at most {_checks.MAX_SEQLEN - 1} supported")
    if fp8_cache:
        for name, x in (("k_descale", k_descale), ("v_descale", v_descale)):
            check_cache_descale(name, x, batch, heads_kv)
    shape = _checks.AttentionShape(batch, seqlen_q, capacity, heads, head_dim, kind, heads_kv, head_dim_v)
    return shape, page_shift


def check_fp8_cache(k_cache, v_cache, k_descale, v_descale) -> bool:
    """Whether the cache is FP8 (k_cache and v_cache uint8, e4m3 bits, with both descales), or
    TypeError / ValueError naming what is missing or mixed."""
    eight = [x.dtype == numpy.uint8 for x in (k_cache, v_cache)]
    if not any(eight) and k_descale is None and v_descale is None:
        return False
    if eight[0] != eight[1]:
        ours, other = ("k_cache", "v_cache") if eight[0] else ("v_cache", "k_cache")
        raise TypeError(f"{ours} holds FP8 bits (uint8) but {other} has dtype {(v_cache if eight[0] else k_cache).dtype}; "
                        "an FP8 cache has both in e4m3")
    if not eight[0]:
        name = "k_descale" if k_descale is not None else "v_descale"
        raise ValueError(f"{name} is for an FP8 cache (k_cache and v_cache uint8, e4m3 bits); the cache has dtype "
                         f"{k_cache.dtype}")
    for name, x in (("k_descale", k_descale), ("v_descale", v_descale)):
        if x is None:
            raise ValueError(f"{name} is missing: an FP8 cache (uint8 k_cache, v_cache) needs k_descale and v_descale")
    return True


def check_cache_descale(name: str, x, batch: int, heads_kv: int) -> None:
    """An FP8 cache's descale: float32 (batch, heads_kv) or (heads_kv,) (one per K/V head)."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"{name} must be a float32 array of shape (batch, heads_kv), got {type(x).__name__}")
    if x.dtype != numpy.float32:
        raise TypeError(f"{name} has dtype {x.dtype}; expected float32")
    if tuple(int(n) for n in x.shape) not in ((batch, heads_kv), (heads_kv,)):
        raise ValueError(f"{name} has shape {tuple(x.shape)}; expected (batch, heads_kv) = {(batch, heads_kv)} or "
                         f"(heads_kv,) = {(heads_kv,)}")


def check_rotary(rotary_cos, rotary_sin, interleaved, q, shape) -> bool:
    """flash_decode's rotary options (reads .shape/.dtype/.ndim only); returns ``interleaved``."""
    interleaved = _checks.check_flag("rotary_interleaved", interleaved)
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin come together: pass both or neither")
    if rotary_cos is None:
        return interleaved
    for name, x in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if getattr(x, "ndim", None) != 2:
            raise ValueError(f"{name} must have 2 dimensions (seqlen_ro, rotary_dim / 2), got shape "
                             f"{tuple(getattr(x, 'shape', ()))}")
        if x.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {x.dtype} but q has dtype {q.dtype}")
    if tuple(rotary_sin.shape) != tuple(rotary_cos.shape):
        raise ValueError(f"rotary_sin has shape {tuple(rotary_sin.shape)} but rotary_cos has {tuple(rotary_cos.shape)}")
    seqlen_ro, half = (int(n) for n in rotary_cos.shape)
    if not 1 <= half <= shape.head_dim // 2:
        raise ValueError(f"rotary_cos has {half} columns (rotary_dim / 2); rotary_dim must be 2 to head_dim = "
                         f"{shape.head_dim}")
    if seqlen_ro < shape.seqlen_k:
        raise ValueError(f"rotary_cos has {seqlen_ro} rows but the cache holds {shape.seqlen_k} keys a sequence; "
                         "it needs a row for each position")
    return interleaved


def _rotated(q, k_new, cos, sin, interleaved: bool, cache_seqlens, shape, q_moves: bool):
    """(q, k_new) rotated by flash_rotary_kernel (decode.cu) into new contiguous arrays; ``q_moves``:
    q's rows at successive positions (causal or a window), else all at cache_seqlens[b]."""
    import cupy

    out_q = cupy.empty(q.shape, q.dtype)
    out_k = None if k_new is None else cupy.empty(k_new.shape, k_new.dtype)
    seqlen_new = 0 if k_new is None else int(k_new.shape[1])
    rows = shape.batch * (shape.seqlen_q * shape.heads + seqlen_new * shape.heads_kv)
    warps = _traits.ROW_KERNEL_THREADS // 32
    _, kernel = family.rotary(shape.dtype, interleaved)
    q_strides = [s // q.itemsize for s in q.strides[:3]]
    k_strides = [0, 0, 0] if k_new is None else [s // k_new.itemsize for s in k_new.strides[:3]]
    kernel((min(-(-rows // warps), 2**31 - 1),), (_traits.ROW_KERNEL_THREADS,),
           (q, *(numpy.int64(n) for n in q_strides), q if k_new is None else k_new, *(numpy.int64(n) for n in k_strides),
            out_q, out_q if out_k is None else out_k, cos, sin, cache_seqlens,
            *(numpy.int32(n) for n in (shape.batch, shape.seqlen_q, shape.heads, seqlen_new, shape.heads_kv,
                                       shape.head_dim, 2 * int(cos.shape[1]), int(cos.shape[0]), int(q_moves)))))
    return out_q, out_k


def _in_place_ready(name, x):
    """The cache is written in place: it cannot be copied, so it must already be kernel-ready."""
    if not _checks.readable_in_place(x):
        raise ValueError(f"{name} must have a contiguous last axis and 16-byte aligned rows (it is updated in "
                         "place, so it cannot be copied)")
    return x


def flash_decode(q, k_cache, v_cache, *, cache_seqlens, k_new=None, v_new=None, block_table=None,
                 cache_batch_idx=None, cache_leftpad=None, rotary_cos=None, rotary_sin=None, rotary_interleaved=False,
                 k_descale=None, v_descale=None, softmax_scale=None, causal=False, window_size=None, softcap=0.0,
                 alibi_slopes=None, sink=None, num_splits=None, head_dim_v=None, stream=None):
    """Attention of new queries against a K/V cache, appending k_new/v_new into it first.

    q: (batch, seqlen_q, heads_q, head_dim) float16/bfloat16, the new tokens' queries.
    k_cache, v_cache: contiguous (batch, capacity, heads_kv, head_dim), or with ``block_table`` a
    paged cache (num_pages, page_size, heads_kv, head_dim) with page_size a power of two >= 16 and
    block_table int32 (batch, pages per sequence): key j of sequence b is row j % page_size of page
    block_table[b, j // page_size]. heads_q a multiple of heads_kv (GQA/MQA: the group's query
    heads share one read of the cache).
    cache_seqlens: int32 (batch,) on the GPU, the keys already in each sequence's cache. It is read
    on the device only (never copied to the host), so the call can be captured in a CUDA graph and
    replayed as the lengths change; it is not modified (advance it yourself, e.g.
    ``cache_seqlens += seqlen_new``).
    v_cache's (and v_new's) head_dim may differ from q's and k_cache's (o takes it): q's and k's
    head_dim any multiple of 8 to 576, v's to 512. MLA (DeepSeek's latent cache): k_cache
    (pages, page_size, 1, 576) and v_cache = k_cache[..., :512], a view of the same rows (append
    with v_new = k_new[..., :512]; no rotary, which would turn k's first columns but not v's); or,
    where views cannot be passed (JAX), v_cache=None with head_dim_v=512, which means the same (v_new
    then None: its rows are k_new's first columns; v_descale, if None, k_descale).
    head_dim_v: v's head_dim where v_cache is None (else None, or v_cache's).
    k_new, v_new: (batch, seqlen_new, heads_kv, head_dim), written into the cache in place at rows
    cache_seqlens[b] .. + seqlen_new - 1 before the attention, which then sees
    cache_seqlens[b] + seqlen_new keys. The caller leaves room: rows past the capacity are dropped.
    Query i of the seqlen_q new ones sits at position i + seqlen_k - seqlen_q (bottom-right, as
    FlashAttention): ``causal`` masks the keys after it (causal among the new tokens);
    ``window_size``, ``softcap``, ``alibi_slopes`` and ``sink`` as in flash_forward.
    num_splits: split the keys into this many ranges computed in parallel and merged exactly
    (default: chosen from the SM count and the work, sized for the capacity).
    FlashAttention-2's ``flash_attn_with_kvcache`` options:
    cache_batch_idx: int32 (batch,) on the GPU: sequence b's cache is row cache_batch_idx[b] of a
    contiguous k_cache / v_cache of any number of rows (not with block_table); a row outside them
    makes the sequence see no key and drops its new rows.
    cache_leftpad: int32 (batch,) on the GPU: sequence b's keys start at cache row cache_leftpad[b]
    (the rows before are padding, never seen); positions stay the cache's rows.
    rotary_cos, rotary_sin: (seqlen_ro, rotary_dim / 2) in q's dtype, seqlen_ro >= the capacity,
    rotary_dim even and <= head_dim: q and k_new are rotated before attention (and k_new so into
    the cache): k_new's row t at position cache_seqlens[b] + t, q's row t there too with ``causal``
    or a window, else all of q at cache_seqlens[b] (FlashAttention-2's placement);
    ``rotary_interleaved`` pairs columns (2i, 2i + 1) (GPT-J), else (i, i + rotary_dim / 2)
    (GPT-NeoX). Rotated in float32 and rounded to the dtype once, by a row kernel ahead of the
    decode kernel. Not with new rows where v_cache shares memory with k_cache (a view of it).
    An FP8 cache: k_cache and v_cache uint8 arrays of e4m3 bits (CuPy; PyTorch's and JAX's
    float8_e4m3fn too) with ``k_descale`` and ``v_descale``, float32 (batch, heads_kv) or (heads_kv,),
    read on the device only: sequence b's key row holds values decode(bits) x k_descale[b, head]
    (head_dims multiples of 16). The kernel reads the bytes (half a 16-bit cache's) and converts
    them exactly; k_new and v_new (q's dtype) are appended as the e4m3 bits of x / descale, rounded
    to nearest even and saturated, as ``quantize_fp8`` rounds.

    Returns (o, lse): o like q with v's head_dim; lse float32 (batch, heads_q, seqlen_q).
    """
    if v_cache is None or head_dim_v is not None:
        v_cache, v_new, v_descale = latent_v(k_cache, v_cache, k_new, v_new, k_descale, v_descale, head_dim_v,
                                             rotary_cos is not None or rotary_sin is not None)
    # A repeated call on CuPy arrays without ALiBi, a sink or the kvcache options takes its checked
    # plan (_plans) and launches.
    if (stream is None and alibi_slopes is None and sink is None and cache_batch_idx is None and cache_leftpad is None
            and rotary_cos is None and rotary_sin is None):
        plan = _plans.get(_plan_key(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, softmax_scale,
                                    causal, window_size, softcap, num_splits, k_descale, v_descale))
        if plan is not None:
            result = plan.call(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, k_descale, v_descale)
            if result is not None:
                return result
    return _decode_checked(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, softmax_scale, causal,
                           window_size, softcap, alibi_slopes, sink, num_splits, stream=stream,
                           cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                           rotary=(rotary_cos, rotary_sin, rotary_interleaved), descales=(k_descale, v_descale))


flash_decode.__doc__ = flash_decode.__doc__.rstrip() + "\n" + STREAM_DOC


def check_latent_v(k_cache, v_cache, v_new, head_dim_v, rotary: bool = False) -> int | None:
    """head_dim_v of a call whose v_cache is None (MLA's latent cache: v the first head_dim_v
    columns of each k_cache row; None where v_cache is given), checked against k_cache (its shape
    only), v_new, which must then be None, and ``rotary`` (rotary_cos or rotary_sin given), which
    must then be False."""
    if v_cache is not None:
        if head_dim_v is not None and head_dim_v != getattr(v_cache, "shape", (None,))[-1]:
            raise ValueError(f"head_dim_v is {head_dim_v} but v_cache has head_dim {v_cache.shape[-1]}; pass one or "
                             "the other (head_dim_v is for v_cache=None)")
        return None
    if head_dim_v is None:
        raise ValueError("v_cache is None: pass head_dim_v, and v's rows are the first head_dim_v columns of each "
                         "k_cache row (MLA's latent cache)")
    if isinstance(head_dim_v, (bool, numpy.bool_)) or not isinstance(head_dim_v, numbers.Integral):
        raise TypeError(f"head_dim_v must be an int, got {type(head_dim_v).__name__}")
    if getattr(k_cache, "ndim", None) != 4:
        raise ValueError(f"k_cache must have 4 dimensions, got shape {tuple(getattr(k_cache, 'shape', ()))}")
    head_dim = int(k_cache.shape[3])
    if head_dim_v % 8 or not 8 <= head_dim_v <= min(head_dim, _traits.MAX_HEAD_DIM):
        raise ValueError(f"head_dim_v is {int(head_dim_v)}; with v_cache=None expected a multiple of 8 from 8 to "
                         f"{min(head_dim, _traits.MAX_HEAD_DIM)} (k_cache's head_dim, at most {_traits.MAX_HEAD_DIM})")
    if v_new is not None:
        raise ValueError("v_new must be None where v_cache is None: v's new rows are k_new's first head_dim_v columns")
    if rotary:
        raise ValueError("rotary_cos / rotary_sin are not supported where v_cache is None: the rotation would turn "
                         "k_new's first columns, which are v's too; rotate the new rows' rope part before the call")
    return int(head_dim_v)


def latent_v(k_cache, v_cache, k_new, v_new, k_descale, v_descale, head_dim_v, rotary: bool) -> tuple:
    """(v_cache, v_new, v_descale) of a call (check_latent_v): with v_cache None, views of k_cache's
    and k_new's first head_dim_v columns, and k_descale where v_descale is None."""
    head_dim_v = check_latent_v(k_cache, v_cache, v_new, head_dim_v, rotary)
    if head_dim_v is None:
        return v_cache, v_new, v_descale
    v_new = None if k_new is None else k_new[..., :head_dim_v]
    return k_cache[..., :head_dim_v], v_new, k_descale if v_descale is None else v_descale


@on_stream
def _decode_checked(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, softmax_scale, causal, window_size,
                    softcap, alibi_slopes, sink, num_splits, cache_batch_idx=None, cache_leftpad=None,
                    rotary=(None, None, False), descales=(None, None)):
    """flash_decode with every check, on the stream the wrapper made current; keeps the plan of a
    call that _plan_key describes and that read every array in place."""
    k_descale, v_descale = descales
    given = (q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, cache_batch_idx, cache_leftpad, k_descale,
             v_descale)
    rotary_cos, rotary_sin, rotary_interleaved = rotary
    cache_index = cache_batch_idx is not None or cache_leftpad is not None
    key = None
    if alibi_slopes is None and sink is None and not cache_index and rotary_cos is None and rotary_sin is None:
        key = _plan_key(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, softmax_scale, causal,
                        window_size, softcap, num_splits, k_descale, v_descale)
    k_cache, v_cache = _checks.fp8_as_bits(k_cache), _checks.fp8_as_bits(v_cache)   # PyTorch's and JAX's e4m3
    shape, page_shift = check_decode(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, cache_batch_idx,
                                     cache_leftpad, k_descale, v_descale)
    rotary_interleaved = check_rotary(rotary_cos, rotary_sin, rotary_interleaved, q, shape)
    if rotary_cos is not None and k_new is not None and _checks.may_share_memory(k_cache, v_cache):
        raise ValueError("rotary_cos / rotary_sin are not supported where v_cache shares memory with k_cache (MLA's "
                         "latent cache, v a view of k): the rotation would turn k_new's columns that are v's too; "
                         "rotate the new rows' rope part before the call")
    scale = _checks.check_softmax_scale(softmax_scale, shape.head_dim)
    causal = _checks.check_flag("causal", causal)
    num_splits = check_num_splits(num_splits)
    q, k_cache, v_cache, cache_seqlens = (_checks.as_gpu_array(n, x) for n, x in (
        ("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("cache_seqlens", cache_seqlens)))
    features = dict(window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, sink=sink)
    for name in ("alibi_slopes", "sink"):
        if features[name] is not None:
            features[name] = _checks.as_gpu_array(name, features[name])
    variant = check_variant(shape.batch, shape.heads, causal, head_dim_v=shape.own_head_dim_v, **features)
    if cache_index:
        variant = dataclasses.replace(variant, cache_index=True)
    fp8_cache = k_descale is not None
    if fp8_cache:
        variant = dataclasses.replace(variant, fp8_cache=True)
    with q.device:
        arrays = dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens)
        if block_table is not None:
            arrays["block_table"] = block_table = _checks.as_gpu_array("block_table", block_table)
        if cache_batch_idx is not None:
            arrays["cache_batch_idx"] = cache_batch_idx = _checks.as_gpu_array("cache_batch_idx", cache_batch_idx)
        if cache_leftpad is not None:
            arrays["cache_leftpad"] = cache_leftpad = _checks.as_gpu_array("cache_leftpad", cache_leftpad)
        if rotary_cos is not None:
            arrays["rotary_cos"] = rotary_cos = _checks.as_gpu_array("rotary_cos", rotary_cos)
            arrays["rotary_sin"] = rotary_sin = _checks.as_gpu_array("rotary_sin", rotary_sin)
        if fp8_cache:   # one per (sequence, K/V head), as the kernels index them
            k_descale, v_descale = (_cache_descale(_checks.as_gpu_array(n, x), shape)
                                    for n, x in (("k_descale", k_descale), ("v_descale", v_descale)))
            arrays.update(k_descale=k_descale, v_descale=v_descale)
        if k_new is not None:
            arrays["k_new"] = k_new = _checks.kernel_ready(_checks.as_gpu_array("k_new", k_new))
            arrays["v_new"] = v_new = _checks.kernel_ready(_checks.as_gpu_array("v_new", v_new))
        _checks.same_device(**arrays)
        q = _checks.kernel_ready(q)
        k_cache, v_cache = _in_place_ready("k_cache", k_cache), _in_place_ready("v_cache", v_cache)
        cache_seqlens = _contiguous(cache_seqlens)
        if rotary_cos is not None:   # q and k_new rotated into new arrays, which the kernels then read
            q, k_new = _rotated(q, k_new, _contiguous(rotary_cos), _contiguous(rotary_sin), rotary_interleaved,
                                cache_seqlens, shape, variant.causal or variant.window_left is not None)
        cache = dict(cache_seqlens=cache_seqlens, block_table=_contiguous(block_table), page_shift=page_shift,
                     k_new=k_new, v_new=v_new, cache_batch_idx=_contiguous(cache_batch_idx),
                     cache_leftpad=_contiguous(cache_leftpad), k_descale=k_descale, v_descale=v_descale)
        variant = variant.on_device()
        plan = decode_plan(q, k_cache, v_cache, shape, scale, variant, num_splits, cache=cache)
        arrays = (q, k_cache, v_cache, cache["cache_seqlens"], cache["block_table"], k_new, v_new,
                  cache["cache_batch_idx"], cache["cache_leftpad"], k_descale, v_descale)
        if key is not None and all(x is y for x, y in zip(arrays, given)):   # checked, and no copy made
            _launch.kept(_plans, key, plan)
        return plan.run(arrays)


# Plans of decode calls without ALiBi or a sink that passed the checks with every array readable in
# place, by everything the checks and the plan read (as forward._plans): shapes, strides, dtypes,
# alignment and devices of the arrays, and the options with their types.
_plans: dict = {}


_NONE_OPTIONAL = (None,) * 5   # _plan_key's k_new, v_new, block_table, k_descale, v_descale: all absent


def _plan_key(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, softmax_scale, causal, window_size,
              softcap, num_splits, k_descale=None, v_descale=None):
    ndarray = _checks.cupy_ndarray()
    if type(q) is not ndarray or type(k_cache) is not ndarray or type(v_cache) is not ndarray \
            or type(cache_seqlens) is not ndarray:
        return None
    aligned = q.data.ptr | k_cache.data.ptr | v_cache.data.ptr   # as read in place (block_table need not be)
    if k_new is None and v_new is None and block_table is None and k_descale is None and v_descale is None:
        optional = _NONE_OPTIONAL
    else:
        optional = []
        for x in (k_new, v_new, block_table, k_descale, v_descale):
            if x is None:
                optional.append(None)
            elif type(x) is not ndarray:
                return None
            else:
                optional.append((x.shape, x.strides, x.dtype, x.data.device_id))
                aligned |= x.data.ptr if x is k_new or x is v_new else 0
    if window_size is not None:
        if type(window_size) is not tuple:
            return None
        window_size = (window_size, tuple(type(n) for n in window_size))
    return (q.shape, q.strides, q.dtype, q.data.device_id, k_cache.shape, k_cache.strides, k_cache.dtype,
            k_cache.data.device_id, v_cache.shape, v_cache.strides, v_cache.dtype, v_cache.data.device_id,
            cache_seqlens.shape, cache_seqlens.strides, cache_seqlens.dtype, cache_seqlens.data.device_id,
            *optional, aligned & 15,
            # v a view of k: an MLA kernel, the Hopper one unless the kernels setting says "portable"
            kernels_setting() if v_cache.data.ptr == k_cache.data.ptr else None,
            type(softmax_scale), softmax_scale, type(causal), causal, window_size, type(softcap), softcap,
            type(num_splits), num_splits)


def _cache_descale(x, shape):
    """An FP8 cache's descale as the kernels read it: float32 (batch, heads_kv), C-contiguous (a
    (heads_kv,) one broadcast over the batch: a copy of batch x heads_kv floats). One already so is
    passed through as it is, so that the call can keep its plan (the plan's arrays are the caller's)."""
    import cupy

    want = (shape.batch, shape.heads_kv)
    if tuple(x.shape) == want and x.flags.c_contiguous:
        return x
    return cupy.ascontiguousarray(cupy.broadcast_to(x, want))


def _contiguous(x):
    import cupy

    return None if x is None else cupy.ascontiguousarray(x)


# ---------------------------------------------------------------------------------------------
# merge_attention_states

def check_merge(outputs, lses):
    """(count, shape, dtype name) of a merge; reads .shape/.dtype only."""
    if not isinstance(outputs, (list, tuple)) or not isinstance(lses, (list, tuple)):
        raise TypeError("outputs and lses must be lists (or tuples) of arrays")
    if not outputs:
        raise ValueError("outputs is empty; merge_attention_states needs at least one partial result")
    if len(outputs) != len(lses):
        raise ValueError(f"outputs has {len(outputs)} arrays but lses has {len(lses)}; one lse per output")
    first = outputs[0]
    if getattr(first, "ndim", None) != 4:
        raise ValueError(f"outputs[0] must have 4 dimensions (batch, seqlen_q, heads, head_dim), got shape "
                         f"{tuple(getattr(first, 'shape', ()))}")
    kind = _checks.dtype_name(first.dtype)
    if kind is None:
        raise TypeError(f"outputs[0] has dtype {first.dtype}; expected float16, bfloat16 or float32")
    batch, seqlen_q, heads, head_dim = (int(n) for n in first.shape)
    if not 1 <= head_dim <= _traits.MAX_HEAD_DIM:
        raise ValueError(f"outputs[0] has head_dim {head_dim}; at most {_traits.MAX_HEAD_DIM} supported")
    for i, (o, lse) in enumerate(zip(outputs, lses)):
        if getattr(o, "shape", None) is None or tuple(o.shape) != tuple(first.shape):
            raise ValueError(f"outputs[{i}] has shape {tuple(getattr(o, 'shape', ()))} but outputs[0] has "
                             f"{tuple(first.shape)}")
        if o.dtype != first.dtype:
            raise TypeError(f"outputs[{i}] has dtype {o.dtype} but outputs[0] has {first.dtype}")
        if getattr(lse, "dtype", None) != numpy.float32:
            raise TypeError(f"lses[{i}] has dtype {getattr(lse, 'dtype', type(lse).__name__)}; expected float32")
        if tuple(lse.shape) != (batch, heads, seqlen_q):
            raise ValueError(f"lses[{i}] has shape {tuple(lse.shape)}; expected (batch, heads, seqlen_q) = "
                             f"{(batch, heads, seqlen_q)}")
    if len(outputs) > 2**16:
        raise ValueError(f"{len(outputs)} partial results; at most 65536")
    return len(outputs), first.shape, kind


@on_stream
def merge_attention_states(outputs, lses):
    """Exact attention over the union of disjoint key sets from each set's (o, lse):
    ``lse = logsumexp_s lse_s``, ``o = sum_s exp(lse_s - lse) o_s``. A partial with lse -inf (no key)
    weighs nothing; a row that no partial saw gets o = 0 and lse = -inf (no NaN).

    outputs: list of (batch, seqlen_q, heads, head_dim) arrays of one dtype (float16, bfloat16,
    float32); lses: list of float32 (batch, heads, seqlen_q). Returns (o, lse) in that dtype and
    float32. The building block of split-KV decoding, cascade attention over a shared prefix and
    context-parallel attention. The partials are stacked once (a copy of their size).
    """
    import cupy

    count, shape4, kind = check_merge(outputs, lses)
    outputs = [_checks.as_gpu_array(f"outputs[{i}]", x) for i, x in enumerate(outputs)]
    lses = [_checks.as_gpu_array(f"lses[{i}]", x) for i, x in enumerate(lses)]
    with outputs[0].device:
        _checks.same_device(**{f"outputs[{i}]": x for i, x in enumerate(outputs)},
                            **{f"lses[{i}]": x for i, x in enumerate(lses)})
        dtype = outputs[0].dtype
        # 16-bit values are stacked as their bits (a plain copy, whatever CuPy makes of bfloat16).
        bits = numpy.uint16 if dtype.itemsize == 2 else numpy.float32
        stacked = cupy.stack([x.view(bits) for x in outputs]).view(dtype)
        stacked_lse = cupy.stack(lses)
        batch, seqlen_q, heads, head_dim = (int(n) for n in shape4)
        o = cupy.empty(shape4, dtype=dtype)
        lse = cupy.empty((batch, heads, seqlen_q), dtype=cupy.float32)
        shape = _checks.AttentionShape(batch, seqlen_q, 1, heads, head_dim, kind)
        params = make_params(shape, 1.0, o=o, lse=lse, o_partial=stacked, lse_partial=stacked_lse)
        params["num_splits"] = count
        _, kernel = family.combine(kind, kind, head_dim)
        rows = batch * seqlen_q * heads
        if rows:
            kernel(*family.combine_launch(rows, count, head_dim), (as_argument(params),))
        return o, lse
