"""The CUDA-core family (float32): kernels_cu/forward.cu and backward.cu, on any GPU. Blocks of
_traits.THREADS threads; tiles from _traits.FORWARD_BLOCKS and BACKWARD_BLOCKS (kept there: _checks
bounds every call's grid by them before a family is chosen), shared memory below. The backward sums
dQ by float32 atomics, or (deterministic) in a dQ pass of its own."""

from __future__ import annotations

from .. import _features, _traits
from .._compile import ModuleSpec, get_kernel
from .._launch import Launch
from ._base import BackwardSchedule, Family, check_smem, spec_with, template


# ---- shared memory ------------------------------------------------------------------------------
# Dynamic shared memory of each kernel; mirrors the carve-up at the top of each kernel, which
# traps if it is given less than this.
def forward_smem_bytes(tile: int) -> int:
    block_m, block_n = _traits.FORWARD_BLOCKS[tile]
    ld = tile + 1
    return 4 * (block_m * ld + block_n * ld + block_m * (block_n + 1))


def backward_smem_bytes(tile: int) -> int:
    block_m, block_n = _traits.BACKWARD_BLOCKS[tile]
    ld = tile + 1
    return 4 * (2 * block_n * ld + 2 * block_m * ld + 2 * block_n * (block_m + 1) + 2 * block_m)


def backward_dq_smem_bytes(tile: int) -> int:
    block_m, block_n = _traits.BACKWARD_BLOCKS[tile]
    ld = tile + 1
    return 4 * (2 * block_m * ld + 2 * block_n * ld + block_m * (block_n + 1) + 2 * block_m)


class _CudaCore(Family):
    @classmethod
    def call_spec(cls, device, shape, flags: int) -> ModuleSpec:
        return cls.module_spec(shape.dtype, shape.tile, flags)


class Forward(_CudaCore):
    name = "forward"

    @staticmethod
    def supports(device, shape, variant, setting: str, arrays=(), deterministic: bool = False) -> bool:
        return True   # the last forward family: every call

    @staticmethod
    def module_spec(dtype: str, tile: int, features: int = 0) -> ModuleSpec:
        spec = ModuleSpec("forward", dtype, tile, features=features)
        return spec_with(spec, (Forward.kernel(spec, causal) for causal in (False, True)))

    @staticmethod
    def kernel(spec: ModuleSpec, causal: bool) -> str:
        return template("flash_forward_kernel", spec.ctype, spec.tile, *_traits.FORWARD_BLOCKS[spec.tile], causal,
                        spec.features)

    @staticmethod
    def forward_launch(device, shape, variant, arrays) -> tuple:
        """(Launch, tensor maps, tile counter bytes) of a checked call."""
        spec = Forward.call_spec(device, shape, variant.flags)
        name = Forward.kernel(spec, variant.causal)
        smem = forward_smem_bytes(shape.tile)
        check_smem(device, smem, shape, "the float32 forward")
        block_m, _ = _traits.FORWARD_BLOCKS[shape.tile]
        grid = -(-shape.seqlen_q // block_m) * shape.batch * shape.heads
        return Launch(name, get_kernel(spec, name, smem), grid, _traits.THREADS, smem), (), 0


class Backward(_CudaCore):
    name = "backward"

    @staticmethod
    def supports(device, shape, variant, setting: str, arrays=(), deterministic: bool = False) -> bool:
        return shape.dtype == "float32"

    @staticmethod
    def module_spec(dtype: str, tile: int, features: int = 0) -> ModuleSpec:
        spec = ModuleSpec("backward", dtype, tile, features=features & ~_features.FORWARD_ONLY_FEATURES)
        return spec_with(spec, tuple(Backward.kernel(spec, causal, atomic) for causal in (False, True)
                                     for atomic in (False, True))
                         + tuple(Backward.dq_kernel(spec, causal) for causal in (False, True)))

    @staticmethod
    def kernel(spec: ModuleSpec, causal: bool, atomic_dq: bool) -> str:
        return template("flash_backward_kernel", spec.ctype, spec.tile, *_traits.BACKWARD_BLOCKS[spec.tile], causal,
                        atomic_dq, spec.features)

    @staticmethod
    def dq_kernel(spec: ModuleSpec, causal: bool) -> str:
        return template("flash_backward_dq_kernel", spec.ctype, spec.tile, *_traits.BACKWARD_BLOCKS[spec.tile], causal,
                        spec.features)

    @staticmethod
    def backward_schedule(device, shape, variant, deterministic: bool) -> BackwardSchedule:
        block_m, _ = _traits.BACKWARD_BLOCKS[shape.tile]
        # Atomic calls add dQ into a float32 accumulator that the convert kernel scales into dq;
        # deterministic calls' dQ pass writes dq itself.
        return BackwardSchedule(block_m, row_multiple=None, dq_accum=not deterministic, dq_semaphores=False,
                                dq_convert=not deterministic, spec=Backward.call_spec(device, shape, variant.backward_flags))

    @staticmethod
    def backward_launches(schedule: BackwardSchedule, device, shape, variant, deterministic: bool, arrays: dict) -> tuple:
        """(the launches after the preprocess, tensor map sets, tile counter bytes)."""
        spec, bh = schedule.spec, shape.batch * shape.heads
        block_m, block_n = _traits.BACKWARD_BLOCKS[shape.tile]
        name = Backward.kernel(spec, variant.causal, atomic_dq=not deterministic)
        smem = backward_smem_bytes(shape.tile)
        check_smem(device, smem, shape, "the float32 backward")
        launches = [Launch(name, get_kernel(spec, name, smem), -(-shape.seqlen_k // block_n) * bh, _traits.THREADS, smem)]
        if deterministic:   # dQ in a pass of its own
            name = Backward.dq_kernel(spec, variant.causal)
            smem = backward_dq_smem_bytes(shape.tile)
            launches.append(Launch(name, get_kernel(spec, name, smem), -(-shape.seqlen_q // block_m) * bh,
                                   _traits.THREADS, smem))
        return launches, None, 0


def module_specs(dtype: str, features) -> list:
    """The modules CI's compile check builds for ``dtype`` with each feature set of ``features``: the
    forward for every dtype (its kernel is generic; float16 and bfloat16 calls run the tensor-core
    family), the backward for float32."""
    forward = [Forward.module_spec(dtype, tile, flags) for tile in _traits.HEAD_DIM_TILES for flags in features]
    backward = [Backward.module_spec(dtype, tile, flags) for tile in _traits.HEAD_DIM_TILES for flags in features]
    return forward + (backward if dtype == "float32" else [])
