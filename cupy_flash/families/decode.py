"""The decode family (kernels_cu/decode.cu, float16 / bfloat16, sm_80+): few query rows over many
keys, split over the keys (flash_decode, and flash_forward's split path). Each head-dim tile's
module holds the decode kernel; a dtype's row module holds the append of new K/V rows into the
cache and the combine of split partials (also merge_attention_states', every dtype). MLA's latent
cache has a Hopper kernel of its own (kernels_cu/decode_sm90.cu, sm_90a) on the same grid."""

from __future__ import annotations

from .. import _features, _traits
from .._compile import CTYPES, TENSOR_CORE_DTYPES, ModuleSpec, device_value, get_kernel
from .._launch import Launch
from ._base import check_smem, kernels_setting, spec_with, template
from .rows import row_kernel_grid


def module_spec(dtype: str, tile: int | None = None, features: int = 0) -> ModuleSpec:
    """The decode kernels of a head-dim tile, or (``tile`` None) the dtype's append and combines."""
    if tile is not None:
        spec = ModuleSpec("decode", dtype, tile, features=features & _features.DECODE_FEATURES)
        kernels = [decode_kernel(spec, causal) for causal in (False, True)]
        if takes_mla(tile, spec.features):
            kernels += [mla_kernel(spec, causal) for causal in (False, True)]
        return spec_with(spec, kernels)
    spec = ModuleSpec("decode", dtype)
    # The combine of split partials (float32) and of merge_attention_states' inputs (the dtype
    # itself); the append for the tensor-core dtypes flash_decode takes.
    partials = ("float32",) if dtype == "float32" else ("float32", dtype)
    append = tuple(append_kernel(spec, indexed, fp8) for fp8 in (False, True) for indexed in (False, True)) \
        if dtype in TENSOR_CORE_DTYPES else ()
    rotary = tuple(rotary_kernel(spec, interleaved) for interleaved in (False, True)) if dtype in TENSOR_CORE_DTYPES else ()
    return spec_with(spec, append + rotary + tuple(combine_kernel(spec, p, wide) for p in partials for wide in (False, True)))


def decode_kernel(spec: ModuleSpec, causal: bool) -> str:
    return template("flash_decode_kernel", spec.ctype, spec.tile, _traits.DECODE_WARPS, causal, spec.features)


def takes_mla(tile: int, features: int) -> bool:
    """Whether a decode module of this tile and feature set has the MLA kernel: decoding's own tiles
    (MLA's 576) without a score modifier or cache index (v's own head dim, an FP8 cache)."""
    return tile in _traits.DECODE_ONLY_TILES and not features & ~(_features.FEATURE_HEAD_DIM_V
                                                                   | _features.FEATURE_FP8_CACHE)


def mla_kernel(spec: ModuleSpec, causal: bool) -> str:
    return template("flash_mla_decode_kernel", spec.ctype, spec.tile, causal,
                    bool(spec.features & _features.FEATURE_FP8_CACHE))


MLA_SM90_TARGET = "sm90a"


def mla_sm90_module_spec(dtype: str, fp8_cache: bool = False) -> ModuleSpec:
    """The Hopper MLA kernels (decode_sm90.cu) of a 16-bit dtype, causal and not, on a cache of that
    dtype or (``fp8_cache``) of e4m3 bits, and the device variable holding their dynamic shared
    memory (sizeof their storage, stated in CUDA only; the same for every 16-bit product type)."""
    spec = ModuleSpec("decode_sm90", dtype, _traits.MLA_SM90_D_TILE, MLA_SM90_TARGET,
                      features=_features.FEATURE_FP8_CACHE if fp8_cache else 0)
    return spec_with(spec, [template("flash_mla_decode_sm90_kernel", spec.ctype, causal, fp8_cache) for causal in (False, True)],
                     [template("&mla_decode_sm90_smem_bytes", spec.ctype)])


def uses_mla_sm90(device, shape, variant, k_tma: bool, setting: str | None = None) -> bool:
    """Whether an MLA call (uses_mla_kernel) runs the Hopper kernel: compute capability 9.0 (whose
    blocks take its shared memory: the kernel's static_assert), a 16-bit or FP8 cache of MLA's tile
    that TMA can read (``k_tma``: _tma.maps_supported), the kernels setting not "portable"."""
    setting = kernels_setting() if setting is None else setting
    return setting != "portable" and device.compute_capability == 90 and k_tma and shape.tile == _traits.MLA_SM90_D_TILE


def mla_sm90_box_keys(page_size: int | None) -> int:
    """Keys of one box of the Hopper MLA kernel's k tensor map: a tile's, or a page's where pages
    are shorter (decode_sm90.cu reads the same)."""
    return _traits.MLA_SM90_KEYS if page_size is None else min(_traits.MLA_SM90_KEYS, page_size)


def uses_mla_kernel(device, shape, variant, v_in_k: bool) -> bool:
    """Whether a decode call takes the MLA kernel: v a view of k's first columns, a module that has
    it (takes_mla), more query rows per K/V head than two of flash_decode_kernel's blocks hold (below,
    64-row blocks would be mostly padding), and its shared memory on this device."""
    return (v_in_k and takes_mla(shape.tile, variant.flags & _features.DECODE_FEATURES)
            and shape.group * shape.seqlen_q > 2 * _traits.DECODE_ROWS
            and _traits.mla_decode_smem_bytes(shape.tile, variant.fp8_cache) <= device.smem_per_block)


def append_kernel(spec: ModuleSpec, cache_index: bool = False, fp8_cache: bool = False) -> str:
    """``cache_index``: the sequences' cache rows from cache_batch_idx (FEATURE_CACHE_INDEX);
    ``fp8_cache``: new rows quantised into an e4m3 cache (FEATURE_FP8_CACHE)."""
    name = "flash_append_fp8_kernel" if fp8_cache else "flash_append_kernel"
    return template(name, spec.ctype, *(("true",) if cache_index else ()))


def rotary_kernel(spec: ModuleSpec, interleaved: bool) -> str:
    return template("flash_rotary_kernel", spec.ctype, "true" if interleaved else "false")


def rotary(dtype: str, interleaved: bool) -> tuple:
    """(name, kernel) of flash_decode's rotary embedding of q and k_new (decode.cu)."""
    spec = module_spec(dtype)
    name = rotary_kernel(spec, interleaved)
    return name, get_kernel(spec, name)


def combine_kernel(spec: ModuleSpec, partial_dtype: str, wide: bool) -> str:
    """``wide``: for head_dim_v above _traits.WIDE_TILE (a block per 128-column slice of a row, not
    2 passes of 128 columns a lane over the whole row)."""
    return template("flash_combine_kernel", CTYPES[partial_dtype], spec.ctype, 1 if wide else 2)


def combine_launch(rows: int, splits: int, head_dim_v: int) -> tuple[tuple[int], tuple[int]]:
    """(grid, block) of flash_combine_kernel: one block per row, or above _traits.WIDE_TILE per
    128-column slice of a row (the kernel loops past the grid, a multiple of the slices), as many
    warps as keep each one COMBINE_BATCH splits deep, up to COMBINE_MAX_WARPS."""
    warps = min(_traits.COMBINE_MAX_WARPS, max(1, -(-splits // _traits.COMBINE_BATCH)))
    slices = -(-head_dim_v // _traits.COMBINE_PASS_COLUMNS) if head_dim_v > _traits.WIDE_TILE else 1
    return (min(rows, (2**31 - 1) // slices) * slices,), (32 * warps,)


def combine(dtype: str, partial_dtype: str, head_dim_v: int) -> tuple:
    """(name, kernel) of the combine of ``partial_dtype`` partials of ``head_dim_v`` columns into
    ``dtype`` outputs."""
    spec = module_spec(dtype)
    name = combine_kernel(spec, partial_dtype, head_dim_v > _traits.WIDE_TILE)
    return name, get_kernel(spec, name)


def decode_launches(device, shape, variant, grid: int, num_splits: int, new_rows: int, mla: bool = False,
                    mla_sm90: bool = False) -> list:
    """The launches of a decode call of ``grid`` blocks: the append where ``new_rows`` new K/V rows
    come, the decode kernel (with ``mla``, an MLA kernel: uses_mla_kernel; with ``mla_sm90`` the
    Hopper one, uses_mla_sm90, taking the plan's k tensor map), and the combine where the keys are
    split in ``num_splits``."""
    rows_spec = module_spec(shape.dtype)
    sms = device.multiprocessors
    launches = []
    # The kernels may start before the kernel ahead of them ends (_launch.py): the append and the
    # decode kernel only when their grid fits on the SMs. GQA 8:1 batch 1 (128 blocks) on the H100:
    # 32.6 -> 31.4 us a call at 32k keys, 12.9 -> 11.6 us at 4k; with k_new, the append early too:
    # 12.43 -> 11.72 us at 4k. Launched early, a grid of 256 blocks (1:1, batch 8, unsplit) ran 13%
    # slower (1701 against 1488 us a call), and one of 384 blocks 5% slower.
    if new_rows:
        append_grid = row_kernel_grid(shape.batch * new_rows * shape.heads_kv)
        name = append_kernel(rows_spec, bool(variant.flags & _features.FEATURE_CACHE_INDEX), variant.fp8_cache)
        launches.append(Launch(name, get_kernel(rows_spec, name), append_grid, _traits.ROW_KERNEL_THREADS,
                               early=append_grid <= sms))
    spec = module_spec(shape.dtype, shape.tile, variant.flags)
    maps = None
    if mla_sm90:
        spec = mla_sm90_module_spec(shape.dtype, variant.fp8_cache)
        smem, threads, name = device_value(spec, spec.variables[0]), _traits.MLA_SM90_THREADS, spec.kernels[variant.causal]
        maps = 0
    elif mla:
        smem, threads, name = _traits.mla_decode_smem_bytes(shape.tile, variant.fp8_cache), _traits.MLA_DECODE_THREADS, \
            mla_kernel(spec, variant.causal)
    else:
        smem, threads, name = _traits.decode_smem_bytes(shape.tile, variant.fp8_cache), 32 * _traits.DECODE_WARPS, \
            decode_kernel(spec, variant.causal)
    check_smem(device, smem, shape, "decoding")
    launches.append(Launch(name, get_kernel(spec, name, smem), grid, threads, smem, maps=maps, early=grid <= sms))
    if num_splits > 1:
        (combine_grid,), (combine_threads,) = combine_launch(shape.batch * shape.seqlen_q * shape.heads, num_splits,
                                                             shape.head_dim_v)
        name, kernel = combine(shape.dtype, "float32", shape.head_dim_v)
        launches.append(Launch(name, kernel, combine_grid, combine_threads, early=True))
    return launches


def module_specs(dtype: str, features) -> list:
    """The row module of ``dtype``, and for the tensor-core dtypes each tile's decode kernels (with
    a feature set, also FEATURE_CACHE_INDEX: flash_decode's alone, outside the shared sets), each
    also reading an FP8 cache (FEATURE_FP8_CACHE), and the Hopper MLA kernels."""
    specs = [module_spec(dtype)]
    if dtype in TENSOR_CORE_DTYPES:
        specs += [mla_sm90_module_spec(dtype, fp8) for fp8 in (False, True)]
        specs += [module_spec(dtype, tile, flags | (_features.FEATURE_CACHE_INDEX if flags else 0) | fp8)
                  for tile in _traits.HEAD_DIM_TILES + _traits.DECODE_ONLY_TILES for flags in features
                  for fp8 in (0, _features.FEATURE_FP8_CACHE)]
    return list(dict.fromkeys(specs))
