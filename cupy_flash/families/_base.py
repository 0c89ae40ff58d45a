"""What every kernel family shares: the kernels setting, the device a call runs on, and the shapes
of what a family hands the plans (a module spec, a backward schedule)."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools

from .. import _traits
from .._compile import ModuleSpec
from .._launch import environment_reader

KERNELS_VARIABLE = "CUPY_FLASH_KERNELS"
SETTINGS = ("auto", "portable", "experimental")   # experimental: auto, plus kernels whose device checks are incomplete
_override: contextvars.ContextVar = contextvars.ContextVar("cupy_flash_kernels", default=None)


# The plans' keys hold the setting, so every repeated call reads it (_launch.environment_reader).
_read_environment = environment_reader(KERNELS_VARIABLE)


def kernels_setting() -> str:
    """``use_kernels``'s setting where one is active, else CUPY_FLASH_KERNELS (read on each call),
    else "auto"."""
    setting = _override.get()
    if setting is not None:
        return setting
    setting = _read_environment()
    if setting is None:   # the common case
        return "auto"
    setting = setting.strip().lower() or "auto"
    if setting not in SETTINGS:
        raise ValueError(f"{KERNELS_VARIABLE}={setting!r}; expected one of {', '.join(SETTINGS)}")
    return setting


@contextlib.contextmanager
def use_kernels(setting: str):
    """Within the block, calls of this thread (and task) dispatch as with CUPY_FLASH_KERNELS=setting:
    "portable" runs the mma.sync / CUDA-core kernels on any GPU (tests run both families so)."""
    if setting not in SETTINGS:
        raise ValueError(f"kernels setting {setting!r}; expected one of {', '.join(SETTINGS)}")
    token = _override.set(setting)
    try:
        yield
    finally:
        _override.reset(token)


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    compute_capability: int   # 10 * major + minor
    smem_per_block: int       # the largest dynamic shared memory one block may opt in to
    multiprocessors: int = 1

    @property
    def tensor_core_target(self) -> str:
        return _traits.tensor_core_target(self.compute_capability, self.smem_per_block)


def check_smem(device: DeviceInfo, smem: int, shape, what: str) -> None:
    """A ValueError, before any launch, where ``what`` (a kernel of ``shape``'s call) needs more
    shared memory per block than ``device`` allows: wide head dims on parts of 99 KB a block."""
    if smem > device.smem_per_block:
        raise ValueError(f"{what} at head_dim {shape.widest_head_dim} needs {smem} bytes of shared memory per block; "
                         f"this GPU allows {device.smem_per_block}")


def current_device_id() -> int:
    """The current CUDA device's ordinal: the one way the package asks which device is current (the
    plans' short paths call the same function, looked up once: _launch.CudaCalls.get_device)."""
    import cupy

    return cupy.cuda.runtime.getDevice()


def current_device() -> DeviceInfo:
    """The current CUDA device's DeviceInfo."""
    return device_info(current_device_id())


@functools.lru_cache(maxsize=None)
def device_info(device: int) -> DeviceInfo:
    import cupy

    runtime = cupy.cuda.runtime
    return DeviceInfo(int(cupy.cuda.Device(device).compute_capability),
                      runtime.deviceGetAttribute(runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
                      runtime.deviceGetAttribute(runtime.cudaDevAttrMultiProcessorCount, device))


class Family:
    """A kernel family as the plans see it (families/__init__.py lists them):
    ``supports(device, shape, variant, setting, arrays=(), deterministic=False)``: whether it runs a
    call; ``call_spec(device, shape, flags)``: the module such a call runs; a forward family's
    ``forward_launch``, a backward family's ``backward_schedule`` and ``backward_launches``."""

    name: str

    @classmethod
    def warmup_specs(cls, device, shape, flags: int) -> list:
        """The modules calls of ``shape`` with variant ``flags`` run on ``device`` (python -m cupy_flash warmup)."""
        return [cls.call_spec(device, shape, flags)]


def flag(value: bool) -> str:
    """A bool as a C++ template argument."""
    return "true" if value else "false"


def template(name: str, *arguments) -> str:
    """The name expression ``name<arguments...>`` (bools as C++ bools)."""
    return f"{name}<{', '.join(flag(a) if isinstance(a, bool) else str(a) for a in arguments)}>"


def spec_with(module: ModuleSpec, kernels, variables=()) -> ModuleSpec:
    """``module`` naming its instantiations: the kernels, then the device variables its launcher reads."""
    return dataclasses.replace(module, kernels=tuple(kernels), variables=tuple(variables))


@dataclasses.dataclass(frozen=True)
class BackwardSchedule:
    """What backward_plan needs of a backward family before its launches: the temporaries' layout,
    and the family's own choices (``spec``, ``dq_apart``) that its ``backward_launches`` reads."""

    block_m: int               # query rows of the main kernel's blocks (deterministic dQ: a semaphore each)
    # Row statistics (delta, lse_log2) padded per (batch, head) to a multiple of this; None: delta
    # as (batch, heads, seqlen_q) and no lse_log2 (the CUDA-core kernels)
    row_multiple: int | None
    dq_accum: bool             # dQ summed in a float32 accumulator
    dq_semaphores: bool        # ... in a fixed order: a semaphore per query block
    dq_convert: bool           # the row kernel that scales and casts the accumulator into dq
    spec: ModuleSpec
    dq_apart: tuple | None = None   # Hopper: the dQ kernel's (block_m, block_n, stages) where it runs
