"""Kernel traits: the tile shapes of every kernel, per head-dim tile, kept as data in one place.

Head dims are rounded up to one of ``HEAD_DIM_TILES`` (as FlashAttention-2 does with its 8 tiles);
the kernels zero-fill the columns past the real head_dim, so any multiple of 8 up to 256 works with
only 8 compiled widths per kernel.

The CUDA-core kernels use 128 threads as a 16 x 8 grid, so block_m must be a multiple of 16 and
block_n a multiple of 8 (16 in the backward). The shapes keep each thread's register accumulators
at <= 64 floats per output (no spills) and shared memory under 99 KB, the per-block limit of the
smallest sm_80+ parts (sm_86/sm_89), so one table serves A100, RTX 30/40 and H100.
"""

from __future__ import annotations

import contextvars

from ._features import FEATURE_ALIBI, FEATURE_SINK, FEATURE_SOFTCAP, FEATURE_VARLEN, FEATURE_WINDOW

THREADS = 128   # every portable attention kernel: 4 warps laid out as 16 rows x 8 columns
HEAD_DIM_TILES = (32, 64, 96, 128, 160, 192, 224, 256)
MAX_HEAD_DIM = HEAD_DIM_TILES[-1]
SMEM_LIMIT_BYTES = 99 * 1024

# (block_m, block_n): query rows and key rows per block.
FORWARD_BLOCKS = {32: (64, 64), 64: (64, 64), 96: (64, 64), 128: (64, 64),
                  160: (32, 32), 192: (32, 32), 224: (32, 32), 256: (32, 32)}
# Tensor-core forward (fp16/bf16): tile -> (block_n, num_warps, m_tiles); 128 query rows per block
# (16 * num_warps * m_tiles). Up to d=128, 4 warps of 32 rows (each K/V fragment feeds two mma's);
# above, 8 warps of 16 rows, since 2 x d fp32 accumulators per thread would not fit in registers.
# The first version (64 rows, 4 warps x 16) ran at 0.65-0.73x FlashAttention-2 (bf16, H100, >= 2k).
#
# One table per target, since what fits depends on the part:
#   "sm8x": sm_80+ parts that give a block 99 KB of shared memory (RTX 30/40): block_n 32 at d >= 192.
#   "sm80": A100-class parts (163 KB per block): the 8-warp tiles take 64 keys, as
#           FlashAttention-2 does at d=256.
#   "sm90": H100: also 64 keys at d=128, +5% at 16k and +14% at 1k over 32 (bf16, tile sweep);
#           sm_80's ptxas spills 24 B with that tile, sm_90's none.
# At d=64, block_n 128 was +3-5% at 16k but -6% causal at 1k and spills 8 B on sm_90: kept at 64.
FORWARD_TC = {32: (64, 4, 2), 64: (64, 4, 2), 96: (32, 4, 2), 128: (32, 4, 2),
              160: (64, 8, 1), 192: (32, 8, 1), 224: (32, 8, 1), 256: (32, 8, 1)}
FORWARD_TC_TARGETS = {
    "sm8x": FORWARD_TC,
    "sm80": {**FORWARD_TC, 192: (64, 8, 1), 224: (64, 8, 1), 256: (64, 8, 1)},
    "sm90": {**FORWARD_TC, 128: (64, 4, 2), 192: (64, 8, 1), 224: (64, 8, 1), 256: (64, 8, 1)},
}
# The architecture each target's kernels are compiled and checked for (CI compiles offline), and
# the shared memory a block of that target may use. sm90a is the Hopper family's (wgmma and
# setmaxnreg exist only in sm_90a code, which runs on compute capability 9.0 alone).
TARGET_ARCH = {"sm8x": "sm_80", "sm80": "sm_80", "sm90": "sm_90", "sm90a": "sm_90a"}
SM90_BLOCK_SMEM_BYTES = 227 * 1024   # shared memory one sm_90 block may opt in to (the Hopper kernels' static_asserts read it)
TARGET_SMEM_BYTES = {"sm8x": 99 * 1024, "sm80": 163 * 1024, "sm90": SM90_BLOCK_SMEM_BYTES, "sm90a": SM90_BLOCK_SMEM_BYTES}
TENSOR_CORE_TARGETS = ("sm8x", "sm80", "sm90")   # the mma.sync families' tables

# Hopper forward (kernels_cu/forward_sm90.cu, sm_90a): head-dim tile -> (block_m, block_n, stages).
# block_m = 64 x consumer warpgroups (one producer warpgroup more: 128 * (1 + block_m / 64)
# threads); the K and V tiles of `stages` key blocks are in flight. Head dims are padded to the
# next tile (TMA reads zeros past head_dim). Shared memory is the kernel's (its storage struct);
# the kernel checks at compile time that it fits 227 KB.
# FlashAttention-3's bf16 tiles for reference: d<=64 192x192 (3 consumers), d<=128 128x176
# (causal 128x128), d<=256 128x80, two stages. Measured (bench/tile_sweep.py --sm90, H100, bf16,
# docs/performance.md): d=64 192x128 was +10% at 16k but -30% causal at 4k, and its plain kernel
# spills 44 bytes (3 consumers get 160 registers); d=128 128x176 +3% at 16k and 1k, -2% at 4k, and
# spills 44 bytes with variants; d=256 128x80 +7-8% over 128x64 from 4k.
# Variant instantiations (score modifiers, windows) take these tiles: all compile spill-free.
FORWARD_SM90 = {64: (128, 128, 2), 128: (128, 128, 2), 256: (128, 80, 2)}
# The N of every wgmma a Hopper tile table (or bench/tile_sweep.py) may use: key-block widths (S =
# Q K^T), head-dim tiles (O += P V), the d = 256 backward's halves of a query block (S^T, 32
# queries a consumer) and of the head dim (128). m64nNk16 allows any multiple of 8 up to 256 for
# 16-bit inputs; kernels_cu/sm90_wgmma_ops.cuh has one operation per width (bench/generate_wgmma_ops.py).
SM90_WGMMA_WIDTHS = (32, 64, 80, 96, 112, 128, 144, 160, 176, 192, 224, 256)
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
_SM90_ALL = FEATURE_WINDOW | FEATURE_SOFTCAP | FEATURE_ALIBI | FEATURE_SINK | FEATURE_VARLEN
FORWARD_SM90_FEATURE_SETS = {64: (_SM90_ALL,), 128: (_SM90_ALL,), 256: (_SM90_ALL,)}


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
# queries its one 64-column chunk was consumer 0's alone).
BACKWARD_SM90 = {64: (128, 128, 2), 128: (128, 64, 2), 256: (64, 64, 2)}
_SM90_BACKWARD_FEATURES = _SM90_ALL & ~(FEATURE_SOFTCAP | FEATURE_ALIBI | FEATURE_SINK)
BACKWARD_SM90_FEATURE_SETS = {tile: (_SM90_BACKWARD_FEATURES,) for tile in BACKWARD_SM90}
BACKWARD_SM90_CONSUMERS = 2   # consumer warpgroups of a Hopper backward block (cuda_defines gives the kernel it)
# Where the automatic setting runs it (measured, H100, bf16 and fp16, the Hopper backward against
# the portable one interleaved on the same inputs: docs/results/h100_dispatch_short_*_20261124.json).
# Atomic dQ: 1.04-1.19x from 256 keys at every head dim, 1.19-1.39x at 512; at 128 keys 0.90-1.09x,
# so from 256. Deterministic: 1.16-1.30x from 256 keys without a causal mask; with one, once the
# causal deterministic backward visits query blocks last first (QueryOrder in backward_sm90.cu),
# 1.09-1.17x at 256-512 keys at d <= 128 and 1.00x / 1.21x at 256 / 512 keys at d = 256 (before it,
# d = 64 0.97-0.99x at 256-512 and d = 256 0.92-0.93x at 256, which had kept them portable).
BACKWARD_SM90_MIN_KEYS = {64: 256, 128: 256, 256: 256}
BACKWARD_SM90_DETERMINISTIC_MIN_KEYS = {64: 256, 128: 256, 256: 256}


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
BACKWARD_SM90_DQ_APART = {64: (128, 128, 3), 128: (128, 64, 3), 256: (128, 32, 3)}
# Which calls take it: (deterministic, causal) -> up to how many keys (None: any); absent: none.
# Measured (H200, bf16, 1k-16k, interleaved against the kernel that adds dQ, in
# docs/performance.md): d = 256 1.00-1.05x its atomic calls and 1.31-1.61x its deterministic
# ones (turns there cost 1.28-1.48x the atomic time); d = 64 and 128 atomic 0.79-0.90x (their
# main kernel hides its adds), deterministic d = 64 1.12 / 1.03 / 0.96 / 0.93x at 1k / 2k / 4k /
# 16k without a mask and 1.34 / 1.17 / 1.05 / 1.01x with one, d = 128 1.02 / 1.00 / 0.95 / 0.91x
# and 1.15 / 1.02 / 0.95 / 0.88x. Stages: 3 against 2 at d = 256 1.06-1.09x, d = 64 0.96-1.00x
# (its 2: neutral), d = 128 0.97-1.05x.
BACKWARD_SM90_DQ_APART_KEYS = {
    64: {(True, False): 2048, (True, True): None},
    128: {(True, False): 2048, (True, True): 2048},
    256: {(False, False): None, (False, True): None, (True, False): None, (True, True): None},
}


def _dq_apart_keys(tile: int, flags: int) -> dict:
    """BACKWARD_SM90_DQ_APART_KEYS' entry for calls with variant ``flags`` at ``tile`` (none with flags)."""
    return BACKWARD_SM90_DQ_APART_KEYS.get(tile, {}) if flags == 0 else {}


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
    """The Hopper forward's head-dim tile for ``head_dim`` (<= 256)."""
    return next(tile for tile in FORWARD_SM90 if head_dim <= tile)


def forward_sm90_config(tile: int, flags: int = 0, causal: bool = False, seqlen_k: int = 0) -> tuple[int, int, int, int]:
    """(block_m, head-dim tile, block_n, stages): the Hopper forward's template tile arguments for a
    call with variant ``flags`` (_features.FEATURE_* bits), a causal mask or not, and ``seqlen_k`` keys."""
    min_keys = plain_causal_min_keys.get()
    min_keys = FORWARD_SM90_PLAIN_CAUSAL_MIN_KEYS.get(tile, 0) if min_keys is None else min_keys
    plain = flags == 0 and (not causal or seqlen_k >= min_keys)
    block_m, block_n, stages = FORWARD_SM90_PLAIN.get(tile, FORWARD_SM90[tile]) if plain else FORWARD_SM90[tile]
    return block_m, tile, block_n, stages


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
    return 128 * (1 + BACKWARD_SM90_CONSUMERS)


def tensor_core_target(compute_capability: int, smem_per_block: int) -> str:
    """The tile table for a device: compute capability as 10 * major + minor, and the largest
    dynamic shared memory one block may opt in to."""
    if compute_capability >= 90:
        return "sm90"
    return "sm80" if smem_per_block >= TARGET_SMEM_BYTES["sm80"] else "sm8x"


def forward_tc_config(tile: int, target: str = "sm8x") -> tuple[int, int, int]:
    """(block_n, num_warps, m_tiles) of the tensor-core forward."""
    return FORWARD_TC_TARGETS[target][tile]


def forward_tc_block_m(tile: int, target: str = "sm8x") -> int:
    _, num_warps, m_tiles = forward_tc_config(tile, target)
    return 16 * num_warps * m_tiles


# Tensor-core backward (fp16/bf16): tile -> (block_m, block_n, num_warps, stages, s_key_warps,
# kv_key_warps) per target. The warps form an s_key_warps x rest grid over keys x queries for S^T
# and dP^T, and a kv_key_warps x rest grid over keys x head dim for dK and dV (backward_tc.cu);
# each thread's dK + dV accumulators stay <= 128 fp32 registers. stages = 2 double-buffers Q and
# dO where shared memory allows. FlashAttention-2's shapes: 64 x 128 (128 x 128 at d <= 64) of
# 8 warps with 32 x 32 score tiles and 32 x 64 dK/dV tiles per warp at d <= 128; 64 x 64 above.
BACKWARD_TC_TARGETS = {
    "sm8x": {32: (64, 64, 4, 2, 2, 2), 64: (64, 64, 4, 2, 2, 2), 96: (32, 64, 4, 2, 2, 2),
             128: (64, 64, 4, 1, 2, 2), 160: (32, 32, 4, 1, 2, 2), 192: (32, 32, 4, 1, 2, 2),
             224: (32, 32, 4, 1, 2, 2), 256: (32, 32, 4, 1, 2, 2)},
    "sm80": {32: (128, 128, 8, 2, 4, 8), 64: (64, 128, 8, 2, 4, 4), 96: (64, 64, 8, 2, 4, 4),
             128: (64, 128, 8, 1, 4, 4), 160: (64, 64, 8, 2, 4, 4), 192: (64, 64, 8, 1, 4, 2),
             224: (64, 64, 8, 1, 2, 4), 256: (64, 64, 8, 1, 2, 2)},
    "sm90": {32: (128, 128, 8, 2, 4, 8), 64: (128, 128, 8, 2, 4, 4), 96: (64, 64, 8, 2, 4, 4),
             128: (64, 128, 8, 2, 4, 4), 160: (64, 64, 8, 2, 4, 4), 192: (64, 64, 8, 2, 4, 2),
             224: (64, 64, 8, 2, 4, 4), 256: (64, 64, 8, 1, 4, 2)},
}
# sm80 d=224 and d=256 take 2 key warps for the scores (32 x 16 warp tiles): with 4 (16 x 32), sm_80's ptxas
# spilled 4 bytes in the causal kernels (ptxas sits at 255 registers there and flips with small edits).
# delta and lse_log2 rows are padded to a multiple of this (every block_m divides it).
ROW_STAT_PADDING = 128


def backward_tc_config(tile: int, target: str = "sm8x") -> tuple[int, int, int, int, int, int]:
    """(block_m, block_n, num_warps, stages, s_key_warps, kv_key_warps) of the tensor-core backward."""
    return BACKWARD_TC_TARGETS[target][tile]


def backward_tc_smem_bytes(tile: int, target: str = "sm8x") -> int:
    block_m, block_n, _, stages, _, _ = backward_tc_config(tile, target)
    ld, ldm = tile + 8, block_m + 8
    return 2 * (2 * block_n * ld + 2 * stages * block_m * ld + 2 * block_n * ldm) + 4 * 2 * stages * block_m


# Shared by the main backward kernel (one block per key block) and the deterministic dQ kernel.
BACKWARD_BLOCKS = {32: (64, 64), 64: (32, 64), 96: (32, 32), 128: (32, 32),
                   160: (16, 16), 192: (16, 16), 224: (16, 16), 256: (16, 16)}

# Decoding (decode.cu): 4 warps, each streaming its own 16-key tiles through its shared-memory stages
# beside one 16-row Q tile; the epilogue reuses the stages for the warps' float32 O.
DECODE_WARPS = 4
DECODE_ROWS = 16                      # (token, query head) rows per block
DECODE_KEYS_PER_CHUNK = 16 * DECODE_WARPS   # keys one pass of the block's warps covers
# Tiles in flight per warp. Three stages (two blocks per SM instead of three at head_dim 128)
# measured no faster for 8 query heads per K/V head at batch 1 (1979 against 1986 GB/s at 32k keys)
# and slower elsewhere (1:1 batch 1: 8%, GQA batch 8: 5%).
DECODE_STAGES = 2
# Blocks an SM holds (the kernel's __launch_bounds__ minimum, registers): up to head_dim 128, above.
DECODE_BLOCKS_PER_SM = {128: 3, 256: 2}
# The combine kernel: one block per row, each warp loading COMBINE_BATCH splits at a time, at most
# COMBINE_MAX_WARPS warps.
COMBINE_BATCH = 4
COMBINE_MAX_WARPS = 8


SM_SHARED_BYTES = 227 * 1024               # per SM for blocks on sm_90 (sm_80: 163 KB)


def decode_smem_bytes(tile: int) -> int:
    ld = tile + 8
    loop = 2 * (DECODE_ROWS * ld + DECODE_WARPS * DECODE_STAGES * 2 * 16 * ld)
    merge = 2 * DECODE_ROWS * ld + 4 * DECODE_WARPS * DECODE_ROWS * (tile + 8)
    return max(loop, merge)


def decode_blocks_per_sm(tile: int) -> int:
    """Decode blocks one SM holds: the kernel's __launch_bounds__ minimum (registers), within what
    shared memory allows."""
    bound = DECODE_BLOCKS_PER_SM[128 if tile <= 128 else 256]
    return max(1, min(bound, SM_SHARED_BYTES // (decode_smem_bytes(tile) + 1024)))


# Row-wise kernels (preprocess, dQ convert, GQA sum, decode's append): one warp per row.
ROW_KERNEL_THREADS = 256


def cuda_defines() -> str:
    """The configuration values the kernels compile with, as #defines: _compile writes them into
    flash_interface.cuh, which every kernel file includes, so each is stated here only."""
    values = dict(FLASH_THREADS=THREADS, SM90_BLOCK_SMEM_BYTES=SM90_BLOCK_SMEM_BYTES,
                  BACKWARD_SM90_CONSUMERS=BACKWARD_SM90_CONSUMERS, ROW_KERNEL_THREADS=ROW_KERNEL_THREADS,
                  DECODE_ROWS=DECODE_ROWS, DECODE_STAGES=DECODE_STAGES,
                  DECODE_BLOCKS_PER_SM_TO_128=DECODE_BLOCKS_PER_SM[128],
                  DECODE_BLOCKS_PER_SM_ABOVE_128=DECODE_BLOCKS_PER_SM[256],
                  COMBINE_BATCH=COMBINE_BATCH, COMBINE_MAX_WARPS=COMBINE_MAX_WARPS)
    return "".join(f"#define {name} {value}\n" for name, value in values.items())


def head_dim_tile(head_dim: int) -> int:
    for tile in HEAD_DIM_TILES:
        if head_dim <= tile:
            return tile
    raise ValueError(f"head_dim {head_dim} exceeds {MAX_HEAD_DIM}")


# Dynamic shared memory of each kernel; mirrors the carve-up at the top of each kernel, which
# traps if it is given less than this.
def forward_smem_bytes(tile: int) -> int:
    block_m, block_n = FORWARD_BLOCKS[tile]
    ld = tile + 1
    return 4 * (block_m * ld + block_n * ld + block_m * (block_n + 1))


def forward_tc_smem_bytes(tile: int, target: str = "sm8x", bias: bool = False) -> int:
    # Q tile and one K and one V tile of 2-byte elements, rows padded by 8 elements; with a bias,
    # a float32 bias tile (BLOCK_M x (BLOCK_N + 8)).
    block_m, block_n = forward_tc_block_m(tile, target), forward_tc_config(tile, target)[0]
    return 2 * (block_m + 2 * block_n) * (tile + 8) + (4 * block_m * (block_n + 8) if bias else 0)


def backward_smem_bytes(tile: int) -> int:
    block_m, block_n = BACKWARD_BLOCKS[tile]
    ld = tile + 1
    return 4 * (2 * block_n * ld + 2 * block_m * ld + 2 * block_n * (block_m + 1) + 2 * block_m)


def backward_dq_smem_bytes(tile: int) -> int:
    block_m, block_n = BACKWARD_BLOCKS[tile]
    ld = tile + 1
    return 4 * (2 * block_m * ld + 2 * block_n * ld + block_m * (block_n + 1) + 2 * block_m)
