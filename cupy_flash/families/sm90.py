"""The Hopper family (sm_90a: wgmma, TMA, warp specialisation): kernels_cu/forward_sm90.cu and
backward_sm90.cu, float16 and bfloat16 on a GPU of compute capability exactly 9.0 (sm_90a code
runs there only), head_dim <= 512 forward and <= 256 backward, inputs TMA can read (16-byte-aligned
base and strides).

Its tiles are the tables below (FORWARD_SM90 / FORWARD_SM90_PLAIN, BACKWARD_SM90 /
BACKWARD_SM90_PLAIN, BACKWARD_SM90_DQ_APART), and where each runs. The kernels state their shared
memory, the tile counter's size and the forward's grid (one block per SM or per tile, tiles from the
counter or by stride: forward_sm90_tile_order), device variables read back from the module
(``device_value``), so none of those is restated here."""

from __future__ import annotations

import contextvars
import functools
import math

from .. import _features, _tma, _traits
from .._compile import TENSOR_CORE_DTYPES, ModuleSpec, device_value, get_kernel
from .._features import (
    FEATURE_ALIBI,
    FEATURE_HEAD_DIM_V,
    FEATURE_SINK,
    FEATURE_SOFTCAP,
    FEATURE_VARLEN,
    FEATURE_WINDOW,
)
from .._launch import Launch
from ._base import BackwardSchedule, Family, current_device_id, spec_with, template

# ---- tiles ----------------------------------------------------------------------------------------
# Hopper forward (kernels_cu/forward_sm90.cu, sm_90a): head-dim tile -> (block_m, block_n, stages).
# block_m = 64 x consumer warpgroups (one producer warpgroup more: 128 * (1 + block_m / 64)
# threads); the K and V tiles of `stages` key blocks are in flight. Head dims are padded to the
# next tile (TMA reads zeros past head_dim). Shared memory is the kernel's (its storage struct);
# the kernel checks at compile time that it fits 227 KB.
# FlashAttention-3's bf16 tiles for reference: d<=64 192x192 (3 consumers), d<=128 128x176
# (causal 128x128), d<=256 128x80, two stages. Measured (bench/tile_sweep.py --sm90, H100, bf16,
# docs/decisions.md): d=64 192x128 was +10% at 16k but -30% causal at 4k, and its plain kernel
# spills 44 bytes (3 consumers get 160 registers); d=128 128x176 +3% at 16k and 1k, -2% at 4k, and
# spills 44 bytes with variants; d=256 128x80 +7-8% over 128x64 from 4k; d<=192 a tile of its own,
# 128x112 (O staged in Q's rows; 128x96 and 128x80 no faster at 16k): d = 192 1.04-1.23x cuDNN
# against 0.91-0.94x at 4k-16k on the 256 tile (docs/decisions.md).
# Variant instantiations (score modifiers, windows) take these tiles: all compile spill-free.
# Past 256 (the 512 tile, head dims 264-512) a consumer's O over 512 columns would be 256 registers
# a thread: a tile covers FORWARD_SM90_V_BLOCK of v's columns, its v blocks side by side, each
# computing S whole (1.5x the products at 512 / 512). Q of 128 rows (128 KB), two stages of 32 keys
# (K 32 KB, V's block 16 KB each) and O staged in Q's rows fill 225 of the 227 KB; against one
# stage of 64 keys 1.06 / 1.10 / 1.06x at 1k / 4k / 16k, causal 0.96 / 1.02 / 1.02x (bf16, H100).
FORWARD_SM90 = {64: (128, 128, 2), 128: (128, 128, 2), 192: (128, 112, 2), 256: (128, 80, 2), 512: (128, 32, 2)}
FORWARD_SM90_V_BLOCK = 256
# The N of every wgmma a Hopper tile table (or bench/tile_sweep.py) may use: key-block widths (S =
# Q K^T), head-dim tiles (O += P V), the d = 256 backward's halves of a query block (S^T, 32
# queries a consumer) and of the head dim (128). m64nNk16 allows any multiple of 8 up to 256 for
# 16-bit inputs; kernels_cu/sm90_wgmma_ops.cuh has one operation per width (bench/generate_wgmma_ops.py).
SM90_WGMMA_WIDTHS = (32, 64, 80, 96, 112, 128, 144, 160, 176, 192, 224, 256)
# The same for e4m3 (m64nNk32): the FP8 forward's key blocks and head-dim tiles (FORWARD_SM90_FP8).
SM90_FP8_WGMMA_WIDTHS = (64, 128, 192, 256)
# Plain calls (no variant flag) take these tiles instead, causal ones from FORWARD_SM90_PLAIN_CAUSAL_MIN_KEYS.
# d = 64 192x128, three consumers (H100, interleaved against 128x128 on the same inputs,
# bf16 and fp16): non-causal 2k-16k +8-17% (16k 444 -> 513 TFLOP/s), 1k 1.01-1.07x, 512 0.97-1.04x;
# causal 1k 0.91-0.95x, 2k-16k 0.99-1.08x (16k 428 -> 449). Its variant kernels spill 164 bytes.
# d = 128 128x176 (spill-free now) measured 0.86-0.97x at 1k-4k, 1.01-1.02x at 16k: not taken.
FORWARD_SM90_PLAIN = {64: (192, 128, 2)}
FORWARD_SM90_PLAIN_CAUSAL_MIN_KEYS = {64: 2048}
# Where set, the threshold of every tile instead (forward.plain_causal_tiles_from: the GPU tests).
plain_causal_min_keys: contextvars.ContextVar = contextvars.ContextVar("plain_causal_min_keys", default=None)
# The variant flags each tile's kernels are built with (the largest sets; a variant runs here when
# its flags are a subset of one). The bias stays on the portable kernels (a float32 tile per key
# block would not fit beside the K/V ring).
_SM90_ALL = FEATURE_WINDOW | FEATURE_SOFTCAP | FEATURE_ALIBI | FEATURE_SINK | FEATURE_VARLEN | FEATURE_HEAD_DIM_V
FORWARD_SM90_FEATURE_SETS = {tile: (_SM90_ALL,) for tile in FORWARD_SM90}
# Calls whose v has a head_dim of its own (FEATURE_HEAD_DIM_V) with tiles of their own: (q's and
# k's tile, v's tile) -> (block_m, block_n, stages), each tile a multiple of 64 (whole 128-byte
# rows); S = Q K^T runs at q's width and O += P V at v's. Other pairs take the tile of the larger
# head dim (FORWARD_SM90), reading zeros past each tensor's own. DeepSeek's 192 / 128: Q 48 KB, two
# stages of K and V (84 + 56 KB) and O's own staging tile (32 KB) fill 220 of the 227 KB.
FORWARD_SM90_HEAD_DIM_V = {(192, 128): (128, 112, 2)}


# The Hopper forward runs at every length: with the counter-driven persistent grid causal calls at
# head_dim <= 64 measured 1.22-1.34x the mma.sync kernels at 128-512 keys, bf16 and fp16 (H100,
# interleaved: docs/results/h100_dispatch_short_*_20261124.json).


# The Hopper backward (kernels_cu/backward_sm90.cu): (block_n, block_m, stages) per head-dim
# tile, config order (head-dim tile, block_n, block_m, stages); window and packed batches; score
# modifiers stay on the portable backward. Up to d = 128 its two consumers split a block's 128 keys;
# at d = 256 (64 keys) they split the head dim, since dK and dV of 64 keys x 256 columns do not fit
# one warpgroup's registers; its shared memory is then exactly the 227 KB a block may have. Without
# dQ (BACKWARD_SM90_DQ_APART_KEYS) d = 256 splits the score products instead: consumer 0 S^T,
# consumer 1 dP^T, each 64 keys x 64 queries (against 64 x 32 each: 1.02-1.06x, H100).
# d = 64 takes 128 queries a block, so both consumers have a 64-row piece of dQ's product (with 64
# queries its one 64-column chunk was consumer 0's alone). d = 192 runs the product split alone
# (every call computes dQ apart; consumer 0 owns one 64-column chunk of dK and dV, consumer 1 two):
# plain calls and v's own head_dim (DeepSeek's 192 / 128), the others take the 256 tile.
BACKWARD_SM90 = {64: (128, 128, 2), 128: (128, 64, 2), 192: (64, 64, 2), 256: (64, 64, 2)}
_SM90_BACKWARD_FEATURES = _SM90_ALL & ~(FEATURE_SOFTCAP | FEATURE_ALIBI | FEATURE_SINK)
BACKWARD_SM90_FEATURE_SETS = {tile: (FEATURE_HEAD_DIM_V,) if tile == 192 else (_SM90_BACKWARD_FEATURES,)
                              for tile in BACKWARD_SM90}
# Where the automatic setting runs it (measured, H100, bf16 and fp16, the Hopper backward against
# the portable one interleaved on the same inputs: docs/results/h100_dispatch_short_*_20261124.json).
# Atomic dQ: 1.04-1.19x from 256 keys at every head dim, 1.19-1.39x at 512; at 128 keys 0.90-1.09x,
# so from 256. Deterministic: 1.16-1.30x from 256 keys without a causal mask; with one, once the
# causal deterministic backward visits query blocks last first (QueryOrder in backward_sm90.cu),
# 1.09-1.17x at 256-512 keys at d <= 128 and 1.00x / 1.21x at 256 / 512 keys at d = 256 (before it,
# d = 64 0.97-0.99x at 256-512 and d = 256 0.92-0.93x at 256, which had kept them portable).
BACKWARD_SM90_MIN_KEYS = {64: 256, 128: 256, 192: 256, 256: 256}
BACKWARD_SM90_DETERMINISTIC_MIN_KEYS = {64: 256, 128: 256, 192: 256, 256: 256}


# Plain calls (no backward variant flags; causal or not, atomic or deterministic) take these tiles
# instead (block_n, block_m, stages). d = 128 with 80-query blocks (FlashAttention-3's non-causal
# tile; dQ computed transposed), against the 64-query blocks in interleaved A/B (bf16, 1k-16k,
# docs/results/h100_sm90_bwd_block_m80_*): atomic non-causal 1.04-1.07x, causal 1.02-1.07x,
# deterministic 1.03-1.07x. Variant kernels keep BACKWARD_SM90 (not measured at 80).
BACKWARD_SM90_PLAIN = {128: (128, 80, 2)}


# dQ apart: plain calls (no variant flags) that run the main kernel without dQ (dK and dV only, the
# atomic grid, no turns) and then flash_backward_dq_sm90_kernel (kernels_cu/backward_dq_sm90.cuh) with
# this tile (block_m, block_n, stages): each block holds BLOCK_M query rows' Q and dO and streams
# the keys, so dQ takes no adds and the call is deterministic whether asked or not. It recomputes S
# and dP: 7 products against 5.
BACKWARD_SM90_DQ_APART = {64: (128, 128, 3), 128: (128, 64, 3), 192: (128, 32, 3), 256: (128, 32, 3)}
# Which calls take it: (deterministic, causal) -> up to how many keys (None: any); absent: none.
# Measured (H200, bf16, 1k-16k, interleaved against the kernel that adds dQ, in
# docs/decisions.md): d = 256 1.00-1.05x its atomic calls and 1.31-1.61x its deterministic
# ones (turns there cost 1.28-1.48x the atomic time); d = 64 and 128 atomic 0.79-0.90x (their
# main kernel hides its adds), deterministic d = 64 1.12 / 1.03 / 0.96 / 0.93x at 1k / 2k / 4k /
# 16k without a mask and 1.34 / 1.17 / 1.05 / 1.01x with one, d = 128 1.02 / 1.00 / 0.95 / 0.91x
# and 1.15 / 1.02 / 0.95 / 0.88x. Stages: 3 against 2 at d = 256 1.06-1.09x, d = 64 0.96-1.00x
# (its 2: neutral), d = 128 0.97-1.05x.
_EVERY_CALL = {(deterministic, causal): None for deterministic in (False, True) for causal in (False, True)}
BACKWARD_SM90_DQ_APART_KEYS = {
    64: {(True, False): 2048, (True, True): None},
    128: {(True, False): 2048, (True, True): 2048},
    192: _EVERY_CALL,
    256: _EVERY_CALL,
}


def _dq_apart_keys(tile: int, flags: int) -> dict:
    """BACKWARD_SM90_DQ_APART_KEYS' entry for calls with variant ``flags`` at ``tile`` (none with
    flags but v's own head_dim, which the dQ kernel reads through V's and dO's maps)."""
    return BACKWARD_SM90_DQ_APART_KEYS.get(tile, {}) if flags & ~FEATURE_HEAD_DIM_V == 0 else {}


def backward_sm90_dq_apart_every_call(tile: int, flags: int = 0) -> bool:
    """Whether every call with ``flags`` at ``tile``, atomic or deterministic, causal or not, at
    any length, computes dQ apart (its module then needs no kernel that adds dQ)."""
    keys = _dq_apart_keys(tile, flags)
    return len(keys) == 4 and all(limit is None for limit in keys.values())


def backward_sm90_dq_apart(tile: int, flags: int, deterministic: bool, causal: bool,
                           seqlen_k: int) -> tuple[int, int, int] | None:
    """The dQ kernel's (block_m, block_n, stages) where a Hopper backward call computes dQ apart
    (BACKWARD_SM90_DQ_APART_KEYS), else None."""
    keys = _dq_apart_keys(tile, flags)
    if (deterministic, causal) not in keys or (keys[deterministic, causal] or seqlen_k) < seqlen_k:
        return None
    return BACKWARD_SM90_DQ_APART[tile]


def backward_sm90_module_dq_apart(tile: int, flags: int) -> tuple[tuple[int, int, int] | None, bool]:
    """(the dQ kernel's tile or None, whether the main kernel that adds dQ is needed) for the
    module of ``tile`` and variant ``flags``: what it compiles."""
    return (BACKWARD_SM90_DQ_APART[tile] if _dq_apart_keys(tile, flags) else None,
            not backward_sm90_dq_apart_every_call(tile, flags))


def backward_sm90_config(tile: int, flags: int = 0) -> tuple[int, int, int, int]:
    """(head-dim tile, block_n, block_m, stages): the Hopper backward's template tile arguments for a
    call with backward variant ``flags``."""
    table = BACKWARD_SM90_PLAIN if flags == 0 and tile in BACKWARD_SM90_PLAIN else BACKWARD_SM90
    block_n, block_m, stages = table[tile]
    return tile, block_n, block_m, stages


def sm90_supports_features(feature_sets: dict, tile: int, flags: int) -> bool:
    """Whether a Hopper kernel family compiles ``flags`` at ``tile``: they fit one of its feature
    sets (FORWARD_SM90_FEATURE_SETS, BACKWARD_SM90_FEATURE_SETS)."""
    return any(flags & ~allowed == 0 for allowed in feature_sets[tile])


def forward_sm90_tile(head_dim: int) -> int:
    """The Hopper forward's head-dim tile for ``head_dim`` (<= 512)."""
    return next(tile for tile in FORWARD_SM90 if head_dim <= tile)


def backward_sm90_tile(head_dim: int, flags: int = 0) -> int:
    """The Hopper backward's head-dim tile for ``head_dim`` (<= 256) and backward variant ``flags``:
    the narrowest that compiles them (BACKWARD_SM90_FEATURE_SETS), else the narrowest."""
    tiles = [tile for tile in BACKWARD_SM90 if head_dim <= tile]
    return next((tile for tile in tiles if sm90_supports_features(BACKWARD_SM90_FEATURE_SETS, tile, flags)), tiles[0])


def forward_sm90_config(tile: int, flags: int = 0, causal: bool = False, seqlen_k: int = 0) -> tuple:
    """(block_m, head-dim tile, block_n, stages[, v block]): the Hopper forward's template tile
    arguments for a call with variant ``flags`` (_features.FEATURE_* bits), a causal mask or not,
    and ``seqlen_k`` keys; past 256, the v columns a tile covers (FORWARD_SM90_V_BLOCK)."""
    min_keys = plain_causal_min_keys.get()
    min_keys = FORWARD_SM90_PLAIN_CAUSAL_MIN_KEYS.get(tile, 0) if min_keys is None else min_keys
    plain = flags == 0 and (not causal or seqlen_k >= min_keys)
    block_m, block_n, stages = FORWARD_SM90_PLAIN.get(tile, FORWARD_SM90[tile]) if plain else FORWARD_SM90[tile]
    return (block_m, tile, block_n, stages) + ((FORWARD_SM90_V_BLOCK,) if tile > _traits.WIDE_TILE else ())


def forward_sm90_v_blocks(config: tuple, head_dim_v: int) -> int:
    """The tiles a query block takes: its v blocks past the wide tile (the kernel's TileScheduler), else 1."""
    return -(-head_dim_v // config[4]) if config[1] > _traits.WIDE_TILE else 1


def forward_sm90_head_dim_v_config(shape) -> tuple | None:
    """(block_m, q's tile, block_n, stages, v's tile) for a call whose q and k and whose v take
    tiles of their own (FORWARD_SM90_HEAD_DIM_V), else None."""
    if not shape.own_head_dim_v:
        return None
    tiles = (-(-shape.head_dim // 64) * 64, -(-shape.head_dim_v // 64) * 64)
    if tiles not in FORWARD_SM90_HEAD_DIM_V:
        return None
    block_m, block_n, stages = FORWARD_SM90_HEAD_DIM_V[tiles]
    return block_m, tiles[0], block_n, stages, tiles[1]


def forward_sm90_configs(tile: int, flags: int) -> tuple[tuple[int, int, int, int], ...]:
    """Every config forward_sm90_config gives calls with ``flags`` (the modules CI builds)."""
    calls = ((False, 0), (True, 0), (True, 1 << 30))   # (causal, keys)
    return tuple(dict.fromkeys(forward_sm90_config(tile, flags, causal, keys) for causal, keys in calls))


def forward_sm90_threads(config: tuple) -> int:
    """Threads of a Hopper forward block: a producer warpgroup and one per 64 query rows."""
    return 128 * (1 + config[0] // 64)


def backward_dq_sm90_threads(dq_config: tuple) -> int:
    """Threads of a Hopper dQ block (BACKWARD_SM90_DQ_APART): a producer warpgroup and one per 64 query rows."""
    return 128 * (1 + dq_config[0] // 64)


def backward_sm90_threads(config: tuple) -> int:
    """Threads of a Hopper backward block: a producer warpgroup and the consumers."""
    return 128 * (1 + _traits.BACKWARD_SM90_CONSUMERS)


TARGET = "sm90a"
TILE_COUNTER_BYTES = "&tile_counter_bytes"   # the device variable holding the tile counter's size (sm90_tma.cuh)


def _runs_here(device, shape, setting: str, tiles: dict) -> bool:
    return (setting != "portable" and device.compute_capability == 90 and shape.dtype in TENSOR_CORE_DTYPES
            and shape.widest_head_dim <= max(tiles))


class Forward(Family):
    name = "forward_sm90"

    @staticmethod
    def warmup_specs(device, shape, flags: int) -> list:
        """Every tile config calls of ``shape`` with variant ``flags`` take (causal or not, any length)."""
        config = forward_sm90_head_dim_v_config(shape)
        if config is not None:
            return [Forward.module_spec(shape.dtype, config[1], flags, config)]
        tile = forward_sm90_tile(shape.widest_head_dim)
        return [Forward.module_spec(shape.dtype, tile, flags, config) for config in forward_sm90_configs(tile, flags)]

    @staticmethod
    def supports(device, shape, variant, setting: str, arrays=(), deterministic: bool = False) -> bool:
        """Every variant but ``bias`` (FORWARD_SM90_FEATURE_SETS)."""
        if not _runs_here(device, shape, setting, FORWARD_SM90):
            return False
        tile = forward_sm90_tile(shape.widest_head_dim)
        return (sm90_supports_features(FORWARD_SM90_FEATURE_SETS, tile, variant.flags)
                and all(_tma.maps_supported(x) for x in arrays))

    @staticmethod
    def module_spec(dtype: str, tile: int, features: int, config: tuple) -> ModuleSpec:
        """The module of one tile ``config`` (block_m, head-dim tile, block_n, stages[, v's tile])."""
        spec = ModuleSpec("forward_sm90", dtype, tile, TARGET, features, config)
        return spec_with(spec, (Forward.kernel(spec, causal) for causal in (False, True)),
                         (Forward.smem(spec), TILE_COUNTER_BYTES) + tuple(Forward.tile_order(spec, c) for c in (False, True)))

    @staticmethod
    def kernel(spec: ModuleSpec, causal: bool) -> str:
        return template("flash_forward_sm90_kernel", spec.ctype, *spec.config[:4], causal, spec.features, *spec.config[4:])

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
        config = config or forward_sm90_head_dim_v_config(shape) or forward_sm90_config(
            forward_sm90_tile(shape.widest_head_dim), variant.flags, variant.causal, shape.seqlen_k)
        tile = config[1]
        name, kernel, smem, persistent, counter_bytes = _forward_kernel(current_device_id(), shape.dtype, tile, variant.flags,
                                                                        variant.causal, config)
        block_m, _, block_n = config[:3]
        # One block per SM, or a block per tile, as the kernel states (forward_sm90_tile_order).
        # (The tile count is below 2^31: _checks bounds the portable kernels' grid, of smaller
        # blocks, by it.)
        tiles = -(-shape.seqlen_q // block_m) * shape.batch * shape.heads * forward_sm90_v_blocks(config, shape.head_dim_v)
        grid = min(tiles, device.multiprocessors) if persistent else tiles
        maps = (shape.dtype, block_m, block_n, variant.packed is not None, tuple(_tma.layout_of(x) for x in arrays))
        return Launch(name, kernel, grid, forward_sm90_threads(config), smem), maps, counter_bytes


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
    backward_sm90_dq_apart says so, the dQ kernel (dQ summed in registers and stored once)."""

    name = "backward_sm90"

    @staticmethod
    def call_spec(device, shape, flags: int) -> ModuleSpec:
        return Backward.module_spec(shape.dtype, backward_sm90_tile(shape.widest_head_dim, flags), flags)

    @staticmethod
    def supports(device, shape, variant, setting: str, arrays=(), deterministic: bool = False) -> bool:
        """No softcap, ALiBi or bias; the automatic setting from the lengths where it measured faster
        (BACKWARD_SM90_MIN_KEYS, BACKWARD_SM90_DETERMINISTIC_MIN_KEYS), "experimental" at
        every length (the tests' "hopper" path). ``arrays``: the inputs its tensor maps read (q, k,
        v, do; the outputs it stores by TMA, dq where the dQ kernel runs, are C-contiguous and
        16-byte aligned: _checks.output_buffer)."""
        if not _runs_here(device, shape, setting, BACKWARD_SM90):
            return False
        tile = backward_sm90_tile(shape.widest_head_dim, variant.backward_flags)
        if setting == "auto":
            min_keys = (BACKWARD_SM90_DETERMINISTIC_MIN_KEYS if deterministic else BACKWARD_SM90_MIN_KEYS)[tile]
            if shape.seqlen_k < min_keys:
                return False
        return (sm90_supports_features(BACKWARD_SM90_FEATURE_SETS, tile, variant.backward_flags)
                and all(_tma.maps_supported(x) for x in arrays))

    @staticmethod
    def module_spec(dtype: str, tile: int, features: int = 0) -> ModuleSpec:
        features &= ~_features.FORWARD_ONLY_FEATURES
        spec = ModuleSpec("backward_sm90", dtype, tile, TARGET, features, backward_sm90_config(tile, features))
        dq_config, adds_dq = backward_sm90_module_dq_apart(tile, features)
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
        dq_apart = backward_sm90_dq_apart(spec.tile, spec.features, deterministic, variant.causal, shape.seqlen_k)
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
                                   backward_dq_sm90_threads(dq_apart), smem, maps=1))
            maps += (((("q", dq_block_m), ("k", dq_block_n), ("v", dq_block_n), ("do", dq_block_m),
                       ("dq", _tma.STORE_ROWS)), shape.dtype, packed, layouts),)
        name = Backward.kernel(spec, variant.causal, adds_dq=not dq_apart)
        smem = device_value(spec, Backward.smem(spec))
        grid = grid_of(-(-shape.seqlen_k // block_n) * bh, deterministic and not dq_apart, device)
        launches.append(Launch(name, get_kernel(spec, name, smem), grid, backward_sm90_threads(spec.config), smem,
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


# The FP8 forward (kernels_cu/forward_sm90.cu with T = fa_e4m3; docs/fp8.md): head-dim tile ->
# (block_m, block_n, stages). Key blocks are multiples of 64 keys (V^T's chunks: VtChunk). Measured
# (H100, interleaved): d = 128 128 x 192 1.04-1.06x 128 x 128, 192 x 64 (three consumers)
# 0.93-0.96x; d = 256 128 x 64 0.82-0.88x 128 x 128, where Q, two stages of K and V^T and a bfloat16
# O staging tile fill 225 of the 227 KB. d <= 64 (Q and K in 64-byte rows: operand_row_elements,
# sm90_mma.cuh): 128 x 256 against 128 x 192 1.00-1.09x at 1k-16k, 128 x 128 0.93-1.10x (best at 1k
# causal only), one process each on one H100.
FORWARD_SM90_FP8 = {64: (128, 256, 2), 128: (128, 192, 2), 256: (128, 128, 2)}
# What it takes: causal, windows, the sink, GQA/MQA and packed batches (no score modifier: FP8's
# descales join the scale).
FORWARD_SM90_FP8_FEATURES = FEATURE_WINDOW | FEATURE_SINK | FEATURE_VARLEN


def forward_sm90_fp8_tile(head_dim: int) -> int:
    return next(tile for tile in FORWARD_SM90_FP8 if head_dim <= tile)


class ForwardFp8(Family):
    """The Hopper FP8 forward: e4m3 q, k, v with their descales, bfloat16 O; V^T written first by
    fp8_transpose_v."""

    name = "forward_sm90_fp8"

    @staticmethod
    def supports(device, shape, variant, setting: str, arrays=(), deterministic: bool = False) -> bool:
        return (device.compute_capability == 90 and shape.head_dim <= max(FORWARD_SM90_FP8)
                and variant.flags & ~FORWARD_SM90_FP8_FEATURES == 0)

    @staticmethod
    def module_spec(tile: int, features: int) -> ModuleSpec:
        from .._compile import FP8_DTYPE

        block_m, block_n, stages = FORWARD_SM90_FP8[tile]
        spec = ModuleSpec("forward_sm90", FP8_DTYPE, tile, TARGET, features, (block_m, tile, block_n, stages))
        return spec_with(spec, tuple(Forward.kernel(spec, causal) for causal in (False, True)) + (ForwardFp8.transpose(spec),),
                         (Forward.smem(spec), TILE_COUNTER_BYTES) + tuple(Forward.tile_order(spec, c) for c in (False, True)))

    @staticmethod
    def transpose(spec: ModuleSpec) -> str:
        return template("fp8_transpose_v", spec.ctype)

    @staticmethod
    def forward_launch(device, shape, variant) -> tuple:
        """(the transpose's Launch less its grid, the main kernel's Launch, tile counter bytes)."""
        tile = forward_sm90_fp8_tile(shape.head_dim)
        return _fp8_kernels(current_device_id(), tile, variant.flags, variant.causal, device.multiprocessors,
                            -(-shape.seqlen_q // FORWARD_SM90_FP8[tile][0]) * shape.batch * shape.heads)


@functools.lru_cache(maxsize=None)
def _fp8_kernels(device: int, tile: int, flags: int, causal: bool, multiprocessors: int, tiles: int):
    spec = ForwardFp8.module_spec(tile, flags)
    smem = device_value(spec, Forward.smem(spec))
    order = device_value(spec, Forward.tile_order(spec, causal))
    counter = device_value(spec, TILE_COUNTER_BYTES) if order == 2 else 0
    name = Forward.kernel(spec, causal)
    main = Launch(name, get_kernel(spec, name, smem), min(tiles, multiprocessors) if order > 0 else tiles,
                  forward_sm90_threads(spec.config), smem)
    transpose_name = ForwardFp8.transpose(spec)
    transpose = Launch(transpose_name, get_kernel(spec, transpose_name), 0, _traits.FP8_TRANSPOSE_THREADS)
    return transpose, main, counter


def fp8_module_specs(features) -> list:
    """The FP8 forward's modules CI's compile check builds: plain, and with every flag it takes."""
    flag_sets = (0,) if tuple(features) == (0,) else (0, FORWARD_SM90_FP8_FEATURES)
    return [ForwardFp8.module_spec(tile, flags) for tile in FORWARD_SM90_FP8 for flags in flag_sets]


def module_specs(dtype: str, features) -> list:
    """The modules CI's compile check builds for ``dtype``: plain, and where ``features`` holds more
    than the plain set, the largest feature sets the tile table builds."""
    if dtype not in TENSOR_CORE_DTYPES:
        return []
    specs = []
    for tile, feature_sets in FORWARD_SM90_FEATURE_SETS.items():
        for flags in (0,) + feature_sets if tuple(features) != (0,) else (0,):
            for config in forward_sm90_configs(tile, flags):   # plain calls: two (FORWARD_SM90_PLAIN)
                specs.append(Forward.module_spec(dtype, tile, flags, config))
    if tuple(features) != (0,):   # the pairs of tiles of their own, with every flag the forward takes
        for (tile, v_tile), (block_m, block_n, stages) in FORWARD_SM90_HEAD_DIM_V.items():
            specs.append(Forward.module_spec(dtype, tile, _SM90_ALL, (block_m, tile, block_n, stages, v_tile)))
    for tile, feature_sets in BACKWARD_SM90_FEATURE_SETS.items():
        # (v's own head_dim alone: the dQ kernel's calls, as plain ones)
        for flags in (0, FEATURE_HEAD_DIM_V) + feature_sets if tuple(features) != (0,) else (0,):
            specs.append(Backward.module_spec(dtype, tile, flags))
    return specs
