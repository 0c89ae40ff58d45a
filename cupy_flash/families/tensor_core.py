"""The tensor-core family (float16 / bfloat16 through mma.sync, sm_80+): kernels_cu/forward_tc.cu and
backward_tc.cu. Tiles per target (FORWARD_TC_TARGETS, BACKWARD_TC_TARGETS below: what fits a
block's shared memory on RTX-class parts, the A100, the H100). The backward sums dQ in a float32
accumulator (atomically, or in turns when deterministic), which a row kernel scales and casts."""

from __future__ import annotations

from .. import _features, _traits
from .._compile import TENSOR_CORE_DTYPES, ModuleSpec, get_kernel
from .._launch import Launch
from ._base import BackwardSchedule, Family, check_smem, spec_with, template

# ---- tiles ----------------------------------------------------------------------------------------
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
# Above 256 each block's O covers v's columns / V_SPLIT (_traits.v_split) and the Q tile sets the
# shape: 64 rows and 16 keys fit sm_8x (90 KB at 512), 32 keys sm_80 (117 KB), 128 rows sm_90 (183 KB).
WIDE = (320, 384, 448, 512)
FORWARD_TC = {32: (64, 4, 2), 64: (64, 4, 2), 96: (32, 4, 2), 128: (32, 4, 2),
              160: (64, 8, 1), 192: (32, 8, 1), 224: (32, 8, 1), 256: (32, 8, 1), **{t: (16, 4, 1) for t in WIDE}}
FORWARD_TC_TARGETS = {
    "sm8x": FORWARD_TC,
    "sm80": {**FORWARD_TC, 192: (64, 8, 1), 224: (64, 8, 1), 256: (64, 8, 1), **{t: (32, 4, 1) for t in WIDE}},
    "sm90": {**FORWARD_TC, 128: (64, 4, 2), 192: (64, 8, 1), 224: (64, 8, 1), 256: (64, 8, 1),
             **{t: (32, 8, 1) for t in WIDE}},
}


# A paged K/V cache (flash_forward's block_table, FEATURE_PAGED) takes these targets' tables: on
# sm_90 the 64-key d = 128 tile spilled 56-164 bytes with the page reads beside it (255 registers),
# so paged calls there take sm80's 32 keys.
FORWARD_TC_PAGED_TARGETS = {"sm8x": "sm8x", "sm80": "sm80", "sm90": "sm80"}


def forward_tc_target(target: str, flags: int) -> str:
    """The tile table a tensor-core forward of kernel ``flags`` takes on a device of ``target``."""
    return FORWARD_TC_PAGED_TARGETS[target] if flags & _features.FEATURE_PAGED else target


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
# Above 256: 64 query rows (two 8-query n-tiles of S^T a warp, the fewest ldmatrix.x4 takes) and
# what shared memory then leaves for keys: 32 on sm_90 (209 KB at 512), 16 on sm_80 up to 448
# (151 KB; 512 would need 172). sm_8x parts have no wide backward (110 KB at 320): check_tile.
BACKWARD_TC_TARGETS["sm80"].update({t: (64, 16, 4, 1, 1, 1) for t in WIDE[:-1]})
BACKWARD_TC_TARGETS["sm90"].update({t: (64, 32, 8, 1, 2, 2) for t in WIDE})
# sm80 d=224 and d=256 take 2 key warps for the scores (32 x 16 warp tiles): with 4 (16 x 32), sm_80's ptxas
# spilled 4 bytes in the causal kernels (ptxas sits at 255 registers there and flips with small edits).


def backward_tc_config(tile: int, target: str = "sm8x") -> tuple[int, int, int, int, int, int]:
    """(block_m, block_n, num_warps, stages, s_key_warps, kv_key_warps) of the tensor-core backward."""
    return BACKWARD_TC_TARGETS[target][tile]


def backward_tc_smem_bytes(tile: int, target: str = "sm8x") -> int:
    block_m, block_n, _, stages, _, _ = backward_tc_config(tile, target)
    ld, ldm = tile + 8, block_m + 8
    return 2 * (2 * block_n * ld + 2 * stages * block_m * ld + 2 * block_n * ldm) + 4 * 2 * stages * block_m


def forward_tc_smem_bytes(tile: int, target: str = "sm8x", bias: bool = False) -> int:
    # Q tile and one K and one V tile (the block's v columns) of 2-byte elements, rows padded by 8
    # elements; with a bias, a float32 bias tile (BLOCK_M x (BLOCK_N + 8)).
    block_m, block_n = forward_tc_block_m(tile, target), forward_tc_config(tile, target)[0]
    ld, ld_v = tile + 8, tile // _traits.v_split(tile) + 8
    return 2 * ((block_m + block_n) * ld + block_n * ld_v) + (4 * block_m * (block_n + 8) if bias else 0)


class _TensorCore(Family):
    """Float16 and bfloat16 calls, every variant, on the device's tile table (its target)."""

    @staticmethod
    def supports(device, shape, variant, setting: str, arrays=(), deterministic: bool = False) -> bool:
        return shape.dtype in TENSOR_CORE_DTYPES

    kernel_name: str      # the kernel template
    tiles = None          # (tile, target) -> the template's tile arguments (a table below)
    features_kept = ~0    # the feature bits its kernels see

    @classmethod
    def call_spec(cls, device, shape, flags: int) -> ModuleSpec:
        return cls.module_spec(shape.dtype, shape.tile, device.tensor_core_target, flags)

    @classmethod
    def module_spec(cls, dtype: str, tile: int, target: str, features: int = 0) -> ModuleSpec:
        spec = ModuleSpec(cls.name, dtype, tile, target, features & cls.features_kept)
        return spec_with(spec, (cls.kernel(spec, causal) for causal in (False, True)))

    @classmethod
    def kernel(cls, spec: ModuleSpec, causal: bool) -> str:
        return template(cls.kernel_name, spec.ctype, spec.tile, *cls.tiles(spec.tile, spec.target), causal, spec.features)


class Forward(_TensorCore):
    name, kernel_name, tiles = "forward_tc", "flash_forward_tc_kernel", staticmethod(forward_tc_config)

    @classmethod
    def call_spec(cls, device, shape, flags: int) -> ModuleSpec:
        return cls.module_spec(shape.dtype, shape.tile, forward_tc_target(device.tensor_core_target, flags), flags)

    @staticmethod
    def forward_launch(device, shape, variant, arrays) -> tuple:
        """(Launch, tensor maps, tile counter bytes) of a checked call."""
        target = forward_tc_target(device.tensor_core_target, variant.flags)
        smem = forward_tc_smem_bytes(shape.tile, target, bias=variant.bias is not None)
        check_smem(device, smem, shape, "the forward with a bias" if variant.bias is not None else "the forward")
        spec = Forward.call_spec(device, shape, variant.flags)
        name = Forward.kernel(spec, variant.causal)
        grid = (-(-shape.seqlen_q // forward_tc_block_m(shape.tile, target)) * shape.batch * shape.heads
                * _traits.v_split(shape.tile))
        threads = 32 * forward_tc_config(shape.tile, target)[1]   # 32 x num_warps
        return Launch(name, get_kernel(spec, name, smem), grid, threads, smem), (), 0


class Backward(_TensorCore):
    name, kernel_name, tiles = "backward_tc", "flash_backward_tc_kernel", staticmethod(backward_tc_config)
    features_kept = ~_features.FORWARD_ONLY_FEATURES   # the backward kernels never see the sink

    @classmethod
    def warmup_specs(cls, device, shape, flags: int) -> list:
        """None where no tile of ``shape`` fits the device (calls raise: backward_schedule)."""
        return [cls.call_spec(device, shape, flags)] if shape.tile in BACKWARD_TC_TARGETS[device.tensor_core_target] else []

    @staticmethod
    def backward_schedule(device, shape, variant, deterministic: bool) -> BackwardSchedule:
        target = device.tensor_core_target
        if shape.tile not in BACKWARD_TC_TARGETS[target]:   # none of its tiles fits this part's shared memory
            least = min(backward_tc_smem_bytes(shape.tile, t) for t, tiles in BACKWARD_TC_TARGETS.items() if shape.tile in tiles)
            check_smem(device, max(least, device.smem_per_block + 1), shape, "the backward")
        block_m = backward_tc_config(shape.tile, target)[0]
        return BackwardSchedule(block_m, row_multiple=_traits.ROW_STAT_PADDING, dq_accum=True,
                                dq_semaphores=deterministic, dq_convert=True,
                                spec=Backward.call_spec(device, shape, variant.backward_flags))

    @staticmethod
    def backward_launches(schedule: BackwardSchedule, device, shape, variant, deterministic: bool, arrays: dict) -> tuple:
        """(the launches after the preprocess, tensor map sets, tile counter bytes)."""
        spec = schedule.spec
        _, block_n, num_warps, *_ = backward_tc_config(spec.tile, spec.target)
        name = Backward.kernel(spec, variant.causal)
        smem = backward_tc_smem_bytes(spec.tile, spec.target)
        grid = -(-shape.seqlen_k // block_n) * shape.batch * shape.heads
        return [Launch(name, get_kernel(spec, name, smem), grid, 32 * num_warps, smem)], None, 0


def module_specs(dtype: str, features) -> list:
    """The modules CI's compile check builds for ``dtype`` with each feature set of ``features``, and
    the forward's with a packed set's paged cache (FEATURE_PAGED: this family's alone) on the targets
    whose tables paged calls take (FORWARD_TC_PAGED_TARGETS)."""
    if dtype not in TENSOR_CORE_DTYPES:
        return []
    paged = _features.FEATURE_PAGED
    return [spec for tile in _traits.HEAD_DIM_TILES for flags in features for target in _traits.TENSOR_CORE_TARGETS
            for spec in ((Forward.module_spec(dtype, tile, target, flags),)
                         + ((Forward.module_spec(dtype, tile, target, flags | paged),)
                            if flags & _features.FEATURE_VARLEN and forward_tc_target(target, paged) == target else ())
                         + ((Backward.module_spec(dtype, tile, target, flags),) if tile in BACKWARD_TC_TARGETS[target] else ()))]
