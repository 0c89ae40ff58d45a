"""Kernel traits: the tile shapes of the portable, mma.sync and decode kernels, per head-dim tile, kept
as data in one place (the Hopper family's are its own: families/sm90.py), and the values both sides
of the interface need (cuda_defines).

Head dims are rounded up to one of ``HEAD_DIM_TILES`` (FlashAttention-2's 8 tiles to 256, then steps
of 64 to 512); the kernels zero-fill the columns past the real head_dim, so any multiple of 8 up to
512 works with 12 compiled widths per kernel. Above 256 (WIDE_TILE) the tensor-core forward and
decode split v's columns over V_SPLIT blocks (each recomputes the scores), so that a warp's O stays
within the registers of the 256 tile; what does not fit a part's shared memory is refused before
launch (families.check_smem).

The CUDA-core kernels use 128 threads as a 16 x 8 grid, so block_m must be a multiple of 16 and
block_n a multiple of 8 (16 in the backward). The shapes keep each thread's register accumulators
at <= 64 floats per output (no spills) and shared memory under 99 KB, the per-block limit of the
smallest sm_80+ parts (sm_86/sm_89), so one table serves A100, RTX 30/40 and H100.
"""

from __future__ import annotations

THREADS = 128   # every portable attention kernel: 4 warps laid out as 16 rows x 8 columns
HEAD_DIM_TILES = (32, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
MAX_HEAD_DIM = HEAD_DIM_TILES[-1]
# Decoding alone also takes q / k head dims to 576: DeepSeek's MLA (a 512-column latent, which is
# also v, and 64 rotary columns). v's own head dim stays within MAX_HEAD_DIM (v_tile: two blocks of
# 256 columns, as at 512).
DECODE_ONLY_TILES = (576,)
DECODE_MAX_HEAD_DIM = DECODE_ONLY_TILES[-1]
WIDE_TILE = 256   # the widest tile whose O a warp holds whole; wider ones split v's columns
V_SPLIT = 2       # blocks over v's columns above WIDE_TILE (tensor-core forward, decode)


def v_split(tile: int) -> int:
    """Blocks that share one query block's O columns (tensor-core forward and decode)."""
    return 1 if tile <= WIDE_TILE else V_SPLIT


def v_tile(tile: int) -> int:
    """v (and O) columns of one of those blocks: v's head dim is at most MAX_HEAD_DIM, also under
    decoding's wider tiles (decode.cu's DV_TILE)."""
    return min(tile, MAX_HEAD_DIM) // v_split(tile)
SMEM_LIMIT_BYTES = 99 * 1024

# The CUDA-core family's tiles (families/cuda_core.py), here because _checks bounds every call's
# grid by the smallest of them before a family is chosen.
# (block_m, block_n): query rows and key rows per block.
# Above 256, 16 x 16: a thread's O row (tile / 8 floats) and shared memory (66 KB at 512) fit.
FORWARD_BLOCKS = {32: (64, 64), 64: (64, 64), 96: (64, 64), 128: (64, 64),
                  160: (32, 32), 192: (32, 32), 224: (32, 32), 256: (32, 32),
                  320: (16, 16), 384: (16, 16), 448: (16, 16), 512: (16, 16)}
# Shared by the main backward kernel (one block per key block) and the deterministic dQ kernel.
# Above 384 its shared memory passes 99 KB: sm_80-class parts and up (check_smem).
BACKWARD_BLOCKS = {32: (64, 64), 64: (32, 64), 96: (32, 32), 128: (32, 32),
                   160: (16, 16), 192: (16, 16), 224: (16, 16), 256: (16, 16),
                   320: (16, 16), 384: (16, 16), 448: (16, 16), 512: (16, 16)}

# The architecture each target's kernels are compiled and checked for (CI compiles offline), and
# the shared memory a block of that target may use. sm90a is the Hopper family's (wgmma and
# setmaxnreg exist only in sm_90a code, which runs on compute capability 9.0 alone).
TARGET_ARCH = {"sm8x": "sm_80", "sm80": "sm_80", "sm90": "sm_90", "sm90a": "sm_90a"}
SM90_BLOCK_SMEM_BYTES = 227 * 1024   # shared memory one sm_90 block may opt in to (the Hopper kernels' static_asserts read it)
TARGET_SMEM_BYTES = {"sm8x": 99 * 1024, "sm80": 163 * 1024, "sm90": SM90_BLOCK_SMEM_BYTES, "sm90a": SM90_BLOCK_SMEM_BYTES}
TENSOR_CORE_TARGETS = ("sm8x", "sm80", "sm90")   # the mma.sync families' tables

# Consumer warpgroups of a Hopper backward block (cuda_defines gives the kernel it; its tiles:
# families/sm90.py).
BACKWARD_SM90_CONSUMERS = 2


def tensor_core_target(compute_capability: int, smem_per_block: int) -> str:
    """The tile table for a device: compute capability as 10 * major + minor, and the largest
    dynamic shared memory one block may opt in to."""
    if compute_capability >= 90:
        return "sm90"
    return "sm80" if smem_per_block >= TARGET_SMEM_BYTES["sm80"] else "sm8x"


# delta and lse_log2 rows are padded to a multiple of this (every block_m divides it).
ROW_STAT_PADDING = 128


# Decoding (decode.cu): 4 warps, each streaming its own 16-key tiles through its shared-memory stages
# beside one 16-row Q tile; the epilogue reuses the stages for the warps' float32 O.
DECODE_WARPS = 4
DECODE_ROWS = 16                      # (token, query head) rows per block
DECODE_KEYS_PER_CHUNK = 16 * DECODE_WARPS   # keys one pass of the block's warps covers
# Tiles in flight per warp (an FP8 cache's raw tiles too: four measured no faster, docs/decisions.md,
# Decoding). Three stages (two blocks per SM instead of three at head_dim 128)
# measured no faster for 8 query heads per K/V head at batch 1 (1979 against 1986 GB/s at 32k keys)
# and slower elsewhere (1:1 batch 1: 8%, GQA batch 8: 5%).
DECODE_STAGES = 2
# Above WIDE_TILE one stage: four warps' K tiles and v-split V tiles then fit sm_80's 163 KB.
DECODE_WIDE_STAGES = 1
# Blocks an SM holds (the kernel's __launch_bounds__ minimum, registers): up to head_dim 128, above.
DECODE_BLOCKS_PER_SM = {128: 3, 256: 2}
# MLA decoding (decode.cu's flash_mla_decode_kernel, v a view of k at the DECODE_ONLY_TILES): warps
# as ROW_TILES tiles of 16 rows times V_HALVES shares of v's columns (8 warps, 64 rows a block),
# sharing double-buffered tiles of MLA_DECODE_KEYS keys.
MLA_DECODE_ROW_TILES = 4
MLA_DECODE_V_HALVES = 2
MLA_DECODE_ROWS = 16 * MLA_DECODE_ROW_TILES
MLA_DECODE_THREADS = 32 * MLA_DECODE_ROW_TILES * MLA_DECODE_V_HALVES
MLA_DECODE_KEYS = 32
MLA_DECODE_STAGES = 2
# Its Hopper kernel (decode_sm90.cu, 16-bit caches on compute capability 9.0): the same 64-row
# blocks as two warpgroups over tiles of MLA_SM90_KEYS keys of MLA_SM90_D_TILE columns (q and k;
# v's are MAX_HEAD_DIM). Its shared memory comes from its storage struct (families/decode.py reads
# mla_decode_sm90_smem_bytes from the module).
MLA_SM90_KEYS = 64
MLA_SM90_THREADS = 256
MLA_SM90_D_TILE = 576
# The combine kernel: one block per row (above WIDE_TILE per 128-column slice of a row), each warp
# loading COMBINE_BATCH splits at a time, at most COMBINE_MAX_WARPS warps.
COMBINE_BATCH = 4
COMBINE_MAX_WARPS = 8
COMBINE_PASS_COLUMNS = 128   # o's columns of one pass of a warp (4 a lane), and of a wide row's slice


SM_SHARED_BYTES = 227 * 1024               # per SM for blocks on sm_90 (sm_80: 163 KB)


def decode_stages(tile: int) -> int:
    return DECODE_STAGES if tile <= WIDE_TILE else DECODE_WIDE_STAGES


def decode_smem_bytes(tile: int, fp8_cache: bool = False) -> int:
    # Q, then each warp's stages of a K and a V tile of 16 keys (V: the block's v columns); the
    # epilogue's float32 O per warp reuses the stages. Rows padded by 8 elements. An FP8 cache: the
    # stages hold the raw e4m3 tiles (unpadded bytes), and each warp one converted stage.
    ld, ld_v = tile + 8, v_tile(tile) + 8
    stages = decode_stages(tile)
    if fp8_cache:
        raw = DECODE_WARPS * stages * 16 * (tile + v_tile(tile))
        loop = 2 * (DECODE_ROWS * ld + DECODE_WARPS * 16 * (ld + ld_v)) + raw
    else:
        loop = 2 * (DECODE_ROWS * ld + DECODE_WARPS * stages * 16 * (ld + ld_v))
    merge = 2 * DECODE_ROWS * ld + 4 * DECODE_WARPS * DECODE_ROWS * ld_v
    return max(loop, merge)


def mla_decode_smem_bytes(tile: int, fp8_cache: bool = False) -> int:
    """Q's rows and the stages of shared key tiles (16-bit, rows padded by 8; an FP8 cache: one
    converted tile and the stages' raw rows), then the warp pairs' exchange (per warp: 16 tile
    maxima, 16 row sums, 4 x 32 words of P fragments) and Q's row factors."""
    exchange = 4 * MLA_DECODE_ROW_TILES * MLA_DECODE_V_HALVES * (2 * 16 + 4 * 32) + 4 * MLA_DECODE_ROWS
    if fp8_cache:
        tiles = 2 * (MLA_DECODE_ROWS + MLA_DECODE_KEYS) * (tile + 8) + MLA_DECODE_STAGES * MLA_DECODE_KEYS * tile
    else:
        tiles = 2 * (MLA_DECODE_ROWS + MLA_DECODE_STAGES * MLA_DECODE_KEYS) * (tile + 8)
    return tiles + exchange


def decode_blocks_per_sm(tile: int, fp8_cache: bool = False) -> int:
    """Decode blocks one SM holds: the kernel's __launch_bounds__ minimum (registers), within what
    shared memory allows."""
    bound = DECODE_BLOCKS_PER_SM[128 if tile <= 128 else 256]
    return max(1, min(bound, SM_SHARED_BYTES // (decode_smem_bytes(tile, fp8_cache) + 1024)))


# Row-wise kernels (preprocess, dQ convert, GQA sum, decode's append): one warp per row.
ROW_KERNEL_THREADS = 256


# The FP8 forward's V^T pass (fp8_transpose_v, kernels_cu/forward_sm90.cu): threads a block, the
# keys a block moves, and the keys over which V^T's key order (fp8_p_key) repeats: one e4m3 wgmma's
# K, to which each sequence's V^T rows are padded.
FP8_TRANSPOSE_THREADS = 256
FP8_TRANSPOSE_KEYS = 64
FP8_KEY_GROUP = 32
# quantize_fp8's GPU path (fp8_group_amax_kernel, kernels_cu/preprocess.cu): rows of one (batch,
# head) a block reduces to its amax (one atomic a warp).
FP8_AMAX_ROWS = 64


def cuda_defines() -> str:
    """The configuration values the kernels compile with, as #defines: _compile writes them into
    flash_interface.cuh, which every kernel file includes, so each is stated here only."""
    values = dict(FLASH_THREADS=THREADS, SM90_BLOCK_SMEM_BYTES=SM90_BLOCK_SMEM_BYTES,
                  BACKWARD_SM90_CONSUMERS=BACKWARD_SM90_CONSUMERS, ROW_KERNEL_THREADS=ROW_KERNEL_THREADS,
                  FLASH_WIDE_TILE=WIDE_TILE, FLASH_V_SPLIT=V_SPLIT, FLASH_MAX_HEAD_DIM_V=MAX_HEAD_DIM,
                  DECODE_ROWS=DECODE_ROWS, DECODE_STAGES=DECODE_STAGES, DECODE_WIDE_STAGES=DECODE_WIDE_STAGES,
                  DECODE_BLOCKS_PER_SM_TO_128=DECODE_BLOCKS_PER_SM[128],
                  DECODE_BLOCKS_PER_SM_ABOVE_128=DECODE_BLOCKS_PER_SM[256],
                  MLA_DECODE_ROW_TILES=MLA_DECODE_ROW_TILES, MLA_DECODE_V_HALVES=MLA_DECODE_V_HALVES,
                  MLA_DECODE_KEYS=MLA_DECODE_KEYS, MLA_DECODE_STAGES=MLA_DECODE_STAGES,
                  MLA_SM90_KEYS=MLA_SM90_KEYS, MLA_SM90_THREADS=MLA_SM90_THREADS, MLA_SM90_D_TILE=MLA_SM90_D_TILE,
                  COMBINE_BATCH=COMBINE_BATCH, COMBINE_MAX_WARPS=COMBINE_MAX_WARPS,
                  COMBINE_PASS_COLUMNS=COMBINE_PASS_COLUMNS,
                  FP8_TRANSPOSE_THREADS=FP8_TRANSPOSE_THREADS, FP8_TRANSPOSE_KEYS=FP8_TRANSPOSE_KEYS,
                  FP8_KEY_GROUP=FP8_KEY_GROUP, FP8_AMAX_ROWS=FP8_AMAX_ROWS)
    return "".join(f"#define {name} {value}\n" for name, value in values.items())


def head_dim_tile(head_dim: int) -> int:
    """The tile of a head dim (above MAX_HEAD_DIM, decoding's: callers check which they take)."""
    for tile in HEAD_DIM_TILES + DECODE_ONLY_TILES:
        if head_dim <= tile:
            return tile
    raise ValueError(f"head_dim {head_dim} exceeds {DECODE_MAX_HEAD_DIM}")
