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

THREADS = 128
HEAD_DIM_TILES = (32, 64, 96, 128, 160, 192, 224, 256)
MAX_HEAD_DIM = HEAD_DIM_TILES[-1]
SMEM_LIMIT_BYTES = 99 * 1024

# (block_m, block_n): query rows and key rows per block.
FORWARD_BLOCKS = {32: (64, 64), 64: (64, 64), 96: (64, 64), 128: (64, 64),
                  160: (32, 32), 192: (32, 32), 224: (32, 32), 256: (32, 32)}
# Tensor-core forward (fp16/bf16): tile -> (block_n, num_warps, m_tiles); 128 query rows per block
# (16 * num_warps * m_tiles). Up to d=128, 4 warps of 32 rows (each K/V fragment feeds two mma's);
# above, 8 warps of 16 rows, since 2 x d fp32 accumulators per thread would not fit in registers.
# block_n is 32 at d = 96 and 128 (with 64, the 2 x 16-row tiles spilled 48 bytes at 255 registers)
# and at d >= 192 (shared memory within 99 KB). The first version (64 rows,
# 4 warps x 16) ran at 0.65-0.73x FlashAttention-2 (bf16, H100, seqlen >= 2k).
FORWARD_TC = {32: (64, 4, 2), 64: (64, 4, 2), 96: (32, 4, 2), 128: (32, 4, 2),
              160: (64, 8, 1), 192: (32, 8, 1), 224: (32, 8, 1), 256: (32, 8, 1)}
# On parts that give a block >= 136 KB of shared memory (A100, H100), the 8-warp tiles take 64 keys
# per K/V tile, as FlashAttention-2 does at d=256; 99 KB parts (RTX 30/40) keep the table above.
FORWARD_TC_LARGE_SMEM = {**FORWARD_TC, 192: (64, 8, 1), 224: (64, 8, 1), 256: (64, 8, 1)}
LARGE_SMEM_BYTES = 136 * 1024


def forward_tc_config(tile: int, large_smem: bool) -> tuple[int, int, int]:
    """(block_n, num_warps, m_tiles) of the tensor-core forward."""
    return (FORWARD_TC_LARGE_SMEM if large_smem else FORWARD_TC)[tile]


def forward_tc_block_m(tile: int, large_smem: bool = False) -> int:
    _, num_warps, m_tiles = forward_tc_config(tile, large_smem)
    return 16 * num_warps * m_tiles


# Shared by the main backward kernel (one block per key block) and the deterministic dQ kernel.
BACKWARD_BLOCKS = {32: (64, 64), 64: (32, 64), 96: (32, 32), 128: (32, 32),
                   160: (16, 16), 192: (16, 16), 224: (16, 16), 256: (16, 16)}

# Row-wise kernels (preprocess, dQ convert): one warp per row.
ROW_KERNEL_THREADS = 256


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


def forward_tc_smem_bytes(tile: int, large_smem: bool = False) -> int:
    # Q tile and one K and one V tile of 2-byte elements, rows padded by 8 elements.
    return 2 * (forward_tc_block_m(tile, large_smem) + 2 * forward_tc_config(tile, large_smem)[0]) * (tile + 8)


def backward_smem_bytes(tile: int) -> int:
    block_m, block_n = BACKWARD_BLOCKS[tile]
    ld = tile + 1
    return 4 * (2 * block_n * ld + 2 * block_m * ld + 2 * block_n * (block_m + 1) + 2 * block_m)


def backward_dq_smem_bytes(tile: int) -> int:
    block_m, block_n = BACKWARD_BLOCKS[tile]
    ld = tile + 1
    return 4 * (2 * block_m * ld + 2 * block_n * ld + block_m * (block_n + 1) + 2 * block_m)
