"""The Hopper family (sm_90a: wgmma, TMA, warp specialisation): kernels_cu/forward_sm90.cu and
backward_sm90.cu, float16 and bfloat16 on a GPU of compute capability exactly 9.0 (sm_90a code
runs there only), head_dim <= 256, inputs TMA can read (16-byte-aligned base and strides).

Tiles: _traits.FORWARD_SM90 / FORWARD_SM90_PLAIN, BACKWARD_SM90 / BACKWARD_SM90_PLAIN,
BACKWARD_SM90_DQ_APART. The kernels state their shared memory, the tile counter's size and the
forward's grid (one block per SM or per tile, tiles from the counter or by stride:
forward_sm90_tile_order), device variables read back from the module (``device_value``), so none
of those is restated here."""

from __future__ import annotations

import functools
import math

from .. import _features, _tma, _traits
from .._compile import TENSOR_CORE_DTYPES, ModuleSpec, device_value, get_kernel
from .._launch import Launch
from ._base import BackwardSchedule, Family, current_device_id, spec_with, template

TARGET = "sm90a"
TILE_COUNTER_BYTES = "&tile_counter_bytes"   # the device variable holding the tile counter's size (sm90_tma.cuh)


def _runs_here(device, shape, setting: str, tiles: dict) -> bool:
    return (setting != "portable" and device.compute_capability == 90 and shape.dtype in TENSOR_CORE_DTYPES
            and shape.head_dim <= max(tiles))


class Forward(Family):
    name = "forward_sm90"

    @staticmethod
    def warmup_specs(device, shape, flags: int) -> list:
        """Every tile config calls of ``shape`` with variant ``flags`` take (causal or not, any length)."""
        tile = _traits.forward_sm90_tile(shape.head_dim)
        return [Forward.module_spec(shape.dtype, tile, flags, config) for config in _traits.forward_sm90_configs(tile, flags)]

    @staticmethod
    def supports(device, shape, variant, setting: str, arrays=(), deterministic: bool = False) -> bool:
        """Every variant but ``bias`` (_traits.FORWARD_SM90_FEATURE_SETS)."""
        if not _runs_here(device, shape, setting, _traits.FORWARD_SM90):
            return False
        tile = _traits.forward_sm90_tile(shape.head_dim)
        return (_traits.sm90_supports_features(_traits.FORWARD_SM90_FEATURE_SETS, tile, variant.flags)
                and all(_tma.maps_supported(x) for x in arrays))

    @staticmethod
    def module_spec(dtype: str, tile: int, features: int, config: tuple) -> ModuleSpec:
        """The module of one tile ``config`` (block_m, head-dim tile, block_n, stages)."""
        spec = ModuleSpec("forward_sm90", dtype, tile, TARGET, features, config)
        return spec_with(spec, (Forward.kernel(spec, causal) for causal in (False, True)),
                         (Forward.smem(spec), TILE_COUNTER_BYTES) + tuple(Forward.tile_order(spec, c) for c in (False, True)))

    @staticmethod
    def kernel(spec: ModuleSpec, causal: bool) -> str:
        return template("flash_forward_sm90_kernel", spec.ctype, *spec.config, causal, spec.features)

    @staticmethod
    def smem(spec: ModuleSpec) -> str:
        """The device variable holding the kernel's dynamic shared memory (sizeof its storage)."""
        return template("&forward_sm90_smem_bytes", spec.ctype, *spec.config)

    @staticmethod
    def tile_order(spec: ModuleSpec, causal: bool) -> str:
        """The device variable stating the kernel's grid: 2, one block per SM taking its tiles from a
        counter; 1, one block per SM striding over the tiles; 0, a block per tile."""
        return template("&forward_sm90_tile_order", spec.tile, causal, spec.features)

    @staticmethod
    def forward_launch(device, shape, variant, arrays, config: tuple = ()) -> tuple:
        """(Launch, tensor maps, tile counter bytes) of a checked call on ``arrays`` (q, k, v, o);
        ``config`` overrides the tile table (bench/tile_sweep.py)."""
        tile = _traits.forward_sm90_tile(shape.head_dim)
        config = config or _traits.forward_sm90_config(tile, variant.flags, variant.causal, shape.seqlen_k)
        name, kernel, smem, persistent, counter_bytes = _forward_kernel(current_device_id(), shape.dtype, tile, variant.flags,
                                                                        variant.causal, config)
        block_m, _, block_n, _ = config
        # One block per SM, or a block per tile, as the kernel states (forward_sm90_tile_order).
        # (The tile count is below 2^31: _checks bounds the portable kernels' grid, of smaller
        # blocks, by it.)
        tiles = -(-shape.seqlen_q // block_m) * shape.batch * shape.heads
        grid = min(tiles, device.multiprocessors) if persistent else tiles
        maps = (shape.dtype, block_m, block_n, variant.packed is not None, tuple(_tma.layout_of(x) for x in arrays))
        return Launch(name, kernel, grid, _traits.forward_sm90_threads(config), smem), maps, counter_bytes


@functools.lru_cache(maxsize=None)
def _forward_kernel(device: int, dtype: str, tile: int, flags: int, causal: bool, config: tuple):
    """(name, kernel, shared memory bytes, whether its grid is one block per SM, the size of the tile
    counter it takes its tiles from or 0 where it takes none) of a Hopper forward instantiation on
    ``device``, looked up once."""
    spec = Forward.module_spec(dtype, tile, flags, config)
    smem = device_value(spec, Forward.smem(spec))
    order = device_value(spec, Forward.tile_order(spec, causal))
    counter = device_value(spec, TILE_COUNTER_BYTES) if order == 2 else 0
    name = Forward.kernel(spec, causal)
    return name, get_kernel(spec, name, smem), smem, order > 0, counter


class Backward(Family):
    """The main kernel (dK, dV, and dQ by float32 adds unless dQ is computed apart), and where
    _traits.backward_sm90_dq_apart says so, the dQ kernel (dQ summed in registers and stored once)."""

    name = "backward_sm90"

    @staticmethod
    def call_spec(device, shape, flags: int) -> ModuleSpec:
        return Backward.module_spec(shape.dtype, _traits.forward_sm90_tile(shape.head_dim), flags)

    @staticmethod
    def supports(device, shape, variant, setting: str, arrays=(), deterministic: bool = False) -> bool:
        """No softcap, ALiBi or bias; the automatic setting from the lengths where it measured faster
        (_traits.BACKWARD_SM90_MIN_KEYS, BACKWARD_SM90_DETERMINISTIC_MIN_KEYS), "experimental" at
        every length (the tests' "hopper" path). ``arrays``: the inputs its tensor maps read (q, k,
        v, do; the outputs it stores by TMA, dq where the dQ kernel runs, are C-contiguous and
        16-byte aligned: _checks.output_buffer)."""
        if not _runs_here(device, shape, setting, _traits.BACKWARD_SM90):
            return False
        tile = _traits.forward_sm90_tile(shape.head_dim)
        if setting == "auto":
            min_keys = (_traits.BACKWARD_SM90_DETERMINISTIC_MIN_KEYS if deterministic else _traits.BACKWARD_SM90_MIN_KEYS)[tile]
            if shape.seqlen_k < min_keys:
                return False
        return (_traits.sm90_supports_features(_traits.BACKWARD_SM90_FEATURE_SETS, tile, variant.backward_flags)
                and all(_tma.maps_supported(x) for x in arrays))

    @staticmethod
    def module_spec(dtype: str, tile: int, features: int = 0) -> ModuleSpec:
        features &= ~_features.FORWARD_ONLY_FEATURES
        spec = ModuleSpec("backward_sm90", dtype, tile, TARGET, features, _traits.backward_sm90_config(tile, features))
        dq_config, adds_dq = _traits.backward_sm90_module_dq_apart(tile, features)
        kernels = tuple(Backward.kernel(spec, c) for c in (False, True)) if adds_dq else ()
        variables = (Backward.smem(spec), Backward.dq_box_rows(spec), TILE_COUNTER_BYTES)
        if dq_config:   # dQ apart: the main kernel without dQ, then the dQ kernel
            kernels += (tuple(Backward.kernel(spec, c, adds_dq=False) for c in (False, True))
                        + tuple(Backward.dq_kernel(spec, dq_config, c) for c in (False, True)))
            variables += (Backward.dq_smem(spec, dq_config),)
        return spec_with(spec, kernels, variables)

    @staticmethod
    def kernel(spec: ModuleSpec, causal: bool, adds_dq: bool = True) -> str:
        return template("flash_backward_sm90_kernel", spec.ctype, *spec.config, causal, spec.features, adds_dq)

    @staticmethod
    def dq_kernel(spec: ModuleSpec, dq_config: tuple, causal: bool) -> str:
        return template("flash_backward_dq_sm90_kernel", spec.ctype, spec.tile, *dq_config, causal, spec.features)

    @staticmethod
    def smem(spec: ModuleSpec) -> str:
        return template("&backward_sm90_smem_bytes", spec.ctype, *spec.config)

    @staticmethod
    def dq_smem(spec: ModuleSpec, dq_config: tuple) -> str:
        return template("&backward_dq_sm90_smem_bytes", spec.ctype, spec.tile, *dq_config)

    @staticmethod
    def dq_box_rows(spec: ModuleSpec) -> str:
        """The device variable holding the rows of the dq_accum tensor map's box."""
        return template("&backward_sm90_dq_box_rows", spec.ctype, *spec.config)

    @staticmethod
    def backward_schedule(device, shape, variant, deterministic: bool) -> BackwardSchedule:
        spec = Backward.call_spec(device, shape, variant.backward_flags)
        _, _, block_m, _ = spec.config
        # Calls that compute dQ in a kernel of its own: no float32 accumulator, no turns, no convert kernel.
        dq_apart = _traits.backward_sm90_dq_apart(spec.tile, spec.features, deterministic, variant.causal, shape.seqlen_k)
        # Row statistics padded also to the query blocks (80 rows: the last may end past a multiple
        # of 128) of the main kernel and the dQ kernel, so a block's lse / delta reads stay in its
        # (batch, head)'s rows.
        multiple = math.lcm(_traits.ROW_STAT_PADDING, block_m, dq_apart[0] if dq_apart else 1)
        return BackwardSchedule(block_m, row_multiple=multiple, dq_accum=not dq_apart,
                                dq_semaphores=deterministic and not dq_apart, dq_convert=not dq_apart,
                                spec=spec, dq_apart=dq_apart)

    @staticmethod
    def backward_launches(schedule: BackwardSchedule, device, shape, variant, deterministic: bool, arrays: dict) -> tuple:
        """(the launches after the preprocess, tensor map sets, tile counter bytes): ``arrays`` are
        the call's arrays and temporaries by name (stand-ins: their layouts are read)."""
        spec, dq_apart = schedule.spec, schedule.dq_apart
        _, block_n, block_m, _ = spec.config
        bh = shape.batch * shape.heads
        packed = variant.packed is not None
        # (Without dQ the main kernel's fifth map is never read: dq's stands in for dq_accum.)
        dq_map = ("dq", _tma.STORE_ROWS) if dq_apart else ("dq_accum", device_value(spec, Backward.dq_box_rows(spec)))
        layouts = {name: _tma.layout_of(arrays[name]) for name in ("q", "k", "v", "do", dq_map[0], "dq")}
        maps = (((("q", block_m), ("k", block_n), ("v", block_n), ("do", block_m), dq_map), shape.dtype, packed, layouts),)
        launches = []
        if dq_apart:
            # The dQ kernel first, the main kernel launched early behind it: the two share no
            # output, so the main kernel's persistent blocks take each SM as the dQ kernel's last
            # blocks leave it, and the dQ kernel's tail no longer ends the call on idle SMs
            # (kernels_cu/backward_sm90.cu: allow_dependents, and the main kernel's wait at its end).
            dq_block_m, dq_block_n, _ = dq_apart
            name = Backward.dq_kernel(spec, dq_apart, variant.causal)
            smem = device_value(spec, Backward.dq_smem(spec, dq_apart))
            launches.append(Launch(name, get_kernel(spec, name, smem), -(-shape.seqlen_q // dq_block_m) * bh,
                                   _traits.backward_dq_sm90_threads(dq_apart), smem, maps=1))
            maps += (((("q", dq_block_m), ("k", dq_block_n), ("v", dq_block_n), ("do", dq_block_m),
                       ("dq", _tma.STORE_ROWS)), shape.dtype, packed, layouts),)
        name = Backward.kernel(spec, variant.causal, adds_dq=not dq_apart)
        smem = device_value(spec, Backward.smem(spec))
        grid = grid_of(-(-shape.seqlen_k // block_n) * bh, deterministic and not dq_apart, device)
        launches.append(Launch(name, get_kernel(spec, name, smem), grid, _traits.backward_sm90_threads(spec.config), smem,
                               maps=0, early=bool(dq_apart)))
        return launches, maps, device_value(spec, TILE_COUNTER_BYTES)


def grid_of(tiles: int, deterministic: bool, device) -> int:
    """The Hopper backward's grid for ``tiles`` key blocks (kernels_cu/backward_sm90.cu). Atomic
    dQ: a persistent grid, one block per SM taking key blocks from a counter. Deterministic: a
    block per key block (each takes its own, then finds the counter past the end): a persistent
    block claims its next key block as it issues this one's last loads, and under the turns a
    claimed key block that has not started holds up those waiting for it: causal 512-2k took
    1.2-1.4x longer (H100, bf16 and fp16, d = 64-256). (``tiles`` is below 2^31: _checks bounds
    the portable kernels' grid, of smaller blocks, by it.)"""
    return tiles if deterministic else min(tiles, device.multiprocessors)


def module_specs(dtype: str, features) -> list:
    """The modules CI's compile check builds for ``dtype``: plain, and where ``features`` holds more
    than the plain set, the largest feature sets the tile table builds."""
    if dtype not in TENSOR_CORE_DTYPES:
        return []
    specs = []
    for tile, feature_sets in _traits.FORWARD_SM90_FEATURE_SETS.items():
        for flags in (0,) + feature_sets if tuple(features) != (0,) else (0,):
            for config in _traits.forward_sm90_configs(tile, flags):   # plain calls: two (FORWARD_SM90_PLAIN)
                specs.append(Forward.module_spec(dtype, tile, flags, config))
    for tile, feature_sets in _traits.BACKWARD_SM90_FEATURE_SETS.items():
        for flags in (0,) + feature_sets if tuple(features) != (0,) else (0,):
            specs.append(Backward.module_spec(dtype, tile, flags))
    return specs
