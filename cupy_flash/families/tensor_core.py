"""The tensor-core family (float16 / bfloat16 through mma.sync, sm_80+): kernels_cu/forward_tc.cu and
backward_tc.cu. Tiles per target (_traits.FORWARD_TC_TARGETS, BACKWARD_TC_TARGETS: what fits a
block's shared memory on RTX-class parts, the A100, the H100). The backward sums dQ in a float32
accumulator (atomically, or in turns when deterministic), which a row kernel scales and casts."""

from __future__ import annotations

from .. import _features, _traits
from .._compile import TENSOR_CORE_DTYPES, ModuleSpec, get_kernel
from .._launch import Launch
from ._base import BackwardSchedule, Family, spec_with, template


class _TensorCore(Family):
    """Float16 and bfloat16 calls, every variant, on the device's tile table (its target)."""

    @staticmethod
    def supports(device, shape, variant, setting: str, arrays=(), deterministic: bool = False) -> bool:
        return shape.dtype in TENSOR_CORE_DTYPES

    kernel_name: str      # the kernel template
    tiles = None          # (tile, target) -> the template's tile arguments (a _traits table)
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
    name, kernel_name, tiles = "forward_tc", "flash_forward_tc_kernel", staticmethod(_traits.forward_tc_config)

    @staticmethod
    def forward_launch(device, shape, variant, arrays) -> tuple:
        """(Launch, tensor maps, tile counter bytes) of a checked call."""
        target = device.tensor_core_target
        smem = _traits.forward_tc_smem_bytes(shape.tile, target, bias=variant.bias is not None)
        if smem > _traits.TARGET_SMEM_BYTES[target]:
            raise ValueError(f"bias with head_dim {shape.head_dim} needs {smem} bytes of shared memory per block; "
                             f"this GPU allows {_traits.TARGET_SMEM_BYTES[target]} (use head_dim <= 128, or an "
                             "sm_80/sm_90-class GPU)")
        spec = Forward.call_spec(device, shape, variant.flags)
        name = Forward.kernel(spec, variant.causal)
        grid = -(-shape.seqlen_q // _traits.forward_tc_block_m(shape.tile, target)) * shape.batch * shape.heads
        threads = 32 * _traits.forward_tc_config(shape.tile, target)[1]   # 32 x num_warps
        return Launch(name, get_kernel(spec, name, smem), grid, threads, smem), (), 0


class Backward(_TensorCore):
    name, kernel_name, tiles = "backward_tc", "flash_backward_tc_kernel", staticmethod(_traits.backward_tc_config)
    features_kept = ~_features.FORWARD_ONLY_FEATURES   # the backward kernels never see the sink

    @staticmethod
    def backward_schedule(device, shape, variant, deterministic: bool) -> BackwardSchedule:
        block_m = _traits.backward_tc_config(shape.tile, device.tensor_core_target)[0]
        return BackwardSchedule(block_m, row_multiple=_traits.ROW_STAT_PADDING, dq_accum=True,
                                dq_semaphores=deterministic, dq_convert=True,
                                spec=Backward.call_spec(device, shape, variant.backward_flags))

    @staticmethod
    def backward_launches(schedule: BackwardSchedule, device, shape, variant, deterministic: bool, arrays: dict) -> tuple:
        """(the launches after the preprocess, tensor map sets, tile counter bytes)."""
        spec = schedule.spec
        _, block_n, num_warps, *_ = _traits.backward_tc_config(spec.tile, spec.target)
        name = Backward.kernel(spec, variant.causal)
        smem = _traits.backward_tc_smem_bytes(spec.tile, spec.target)
        grid = -(-shape.seqlen_k // block_n) * shape.batch * shape.heads
        return [Launch(name, get_kernel(spec, name, smem), grid, 32 * num_warps, smem)], None, 0


def module_specs(dtype: str, features) -> list:
    """The modules CI's compile check builds for ``dtype`` with each feature set of ``features``."""
    if dtype not in TENSOR_CORE_DTYPES:
        return []
    return [spec for tile in _traits.HEAD_DIM_TILES for flags in features for target in _traits.TENSOR_CORE_TARGETS
            for spec in (Forward.module_spec(dtype, tile, target, flags), Backward.module_spec(dtype, tile, target, flags))]
