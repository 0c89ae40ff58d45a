"""Kernel families and the dispatch rule: which compiled kernels a call runs on this GPU.

The forward has three families, tried in this order:

    forward_sm90   Hopper (wgmma, TMA, warp specialisation; kernels_cu/forward_sm90.cu): float16 and
                   bfloat16 on a GPU of compute capability exactly 9.0 (sm_90a code runs there only),
                   head_dim <= 256, every variant but ``bias``, inputs TMA can read (16-byte-
                   aligned base and strides)
    forward_tc     tensor cores through mma.sync (sm_80+): float16 and bfloat16 everywhere else
    forward        CUDA cores: float32

``CUPY_FLASH_KERNELS=portable`` (or ``use_kernels("portable")``) keeps calls off the Hopper family.
Each family answers ``supports(device, shape, variant)``; ``forward_family`` is the rule, the one
place that decides.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os

from . import _tma, _traits

KERNELS_VARIABLE = "CUPY_FLASH_KERNELS"
SETTINGS = ("auto", "portable", "experimental")   # experimental: auto, plus kernels whose device checks are incomplete
_override: contextvars.ContextVar = contextvars.ContextVar("cupy_flash_kernels", default=None)


def kernels_setting() -> str:
    """``use_kernels``'s setting where one is active, else CUPY_FLASH_KERNELS (read on each call),
    else "auto"."""
    setting = _override.get()
    if setting is not None:
        return setting
    setting = os.environ.get(KERNELS_VARIABLE)
    if setting is None:   # the common case, in a plan's key on every call: ~1 us less
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


def current_device() -> DeviceInfo:
    import cupy

    return _device_info(cupy.cuda.Device().id)


@functools.lru_cache(maxsize=None)
def _device_info(device: int) -> DeviceInfo:
    import cupy

    runtime = cupy.cuda.runtime
    return DeviceInfo(int(cupy.cuda.Device(device).compute_capability),
                      runtime.deviceGetAttribute(runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
                      runtime.deviceGetAttribute(runtime.cudaDevAttrMultiProcessorCount, device))


# Each family: supports(device, shape, variant, setting, arrays) with arrays the kernel-ready q, k, v
# (empty to ask about the shapes alone).

class ForwardSm90:
    name = "forward_sm90"

    @staticmethod
    def supports(device: DeviceInfo, shape, variant, setting: str, arrays=()) -> bool:
        if setting == "portable" or device.compute_capability != 90 or shape.dtype not in ("float16", "bfloat16"):
            return False
        if shape.head_dim > max(_traits.FORWARD_SM90):
            return False
        tile = _traits.forward_sm90_tile(shape.head_dim)
        return (_traits.sm90_supports_features(_traits.FORWARD_SM90_FEATURE_SETS, tile, variant.flags)
                and all(_tma.maps_supported(x) for x in arrays))


class ForwardTensorCore:
    name = "forward_tc"

    @staticmethod
    def supports(device: DeviceInfo, shape, variant, setting: str, arrays=()) -> bool:
        return shape.dtype in ("float16", "bfloat16")


class ForwardCudaCore:
    name = "forward"

    @staticmethod
    def supports(device: DeviceInfo, shape, variant, setting: str, arrays=()) -> bool:
        return True


FORWARD_FAMILIES = (ForwardSm90, ForwardTensorCore, ForwardCudaCore)


def forward_family(device: DeviceInfo, shape, variant, setting: str | None = None, arrays=()) -> str:
    """The forward kernel family a call runs: the first of FORWARD_FAMILIES that supports it."""
    setting = kernels_setting() if setting is None else setting
    return next(family.name for family in FORWARD_FAMILIES if family.supports(device, shape, variant, setting, arrays))


def backward_family(device: DeviceInfo, shape, variant, deterministic: bool = False, arrays=(),
                    setting: str | None = None) -> str:
    """The float16/bfloat16 backward's main kernel: "backward_sm90" (Hopper, no softcap, ALiBi or
    bias) or "backward_tc". The automatic setting takes the Hopper kernel where it
    measured faster (_traits.BACKWARD_SM90_MIN_KEYS, BACKWARD_SM90_DETERMINISTIC_MIN_KEYS);
    CUPY_FLASH_KERNELS=experimental wherever it runs (what the tests' "hopper" path uses).
    ``arrays``: the inputs its tensor maps read (q, k, v, do; the outputs it stores by TMA, dq
    where the dQ kernel runs, are C-contiguous and 16-byte aligned: _checks.output_buffer)."""
    setting = kernels_setting() if setting is None else setting
    if setting == "portable" or device.compute_capability != 90 or shape.head_dim > max(_traits.BACKWARD_SM90):
        return "backward_tc"
    tile = _traits.forward_sm90_tile(shape.head_dim)
    if setting == "auto":
        min_keys = (_traits.BACKWARD_SM90_DETERMINISTIC_MIN_KEYS if deterministic else _traits.BACKWARD_SM90_MIN_KEYS)[tile]
        if shape.seqlen_k < min_keys:
            return "backward_tc"
    supported = _traits.sm90_supports_features(_traits.BACKWARD_SM90_FEATURE_SETS, tile, variant.backward_flags)
    return "backward_sm90" if supported and all(_tma.maps_supported(x) for x in arrays) else "backward_tc"


FAMILY_DESCRIPTIONS = {"forward_sm90": "Hopper kernels (wgmma, TMA, warp specialisation; sm_90a)",
                       "forward_tc": "tensor-core kernels (mma.sync; sm_80+)",
                       "forward": "CUDA-core kernels"}


def describe_forward(device: DeviceInfo, setting: str | None = None) -> list[str]:
    """What ``python -m cupy_flash info`` says of a GPU: the forward family of each kind of call."""
    from ._checks import AttentionShape
    from ._features import check_variant

    setting = kernels_setting() if setting is None else setting
    lines = []
    for dtype in ("bfloat16", "float16", "float32"):
        shape = AttentionShape(1, 1024, 1024, 8, 128, dtype)
        plain = forward_family(device, shape, check_variant(1, 8, False), setting)
        line = f"{dtype}: {FAMILY_DESCRIPTIONS[plain]}"
        if plain == "forward_sm90":
            line += f"; with a bias: {FAMILY_DESCRIPTIONS['forward_tc']}"
        lines.append(line)
    if setting == "portable":
        lines.append(f"({KERNELS_VARIABLE}=portable: the Hopper kernels are off)")
    return lines


def describe_backward(device: DeviceInfo, setting: str | None = None) -> str:
    """The float16/bfloat16 backward's kernels on a GPU, as ``python -m cupy_flash info`` says it."""
    from ._checks import AttentionShape
    from ._features import check_variant

    setting = kernels_setting() if setting is None else setting
    shape = AttentionShape(1, 16384, 16384, 8, 128, "bfloat16")
    if backward_family(device, shape, check_variant(1, 8, False), setting=setting) != "backward_sm90":
        return "float16/bfloat16: tensor-core kernels (mma.sync; sm_80+)"
    if setting == "experimental":
        return ("float16/bfloat16: Hopper kernels (no softcap, ALiBi or bias; "
                "the others: tensor-core kernels)")

    def from_keys(min_keys: dict) -> str:   # head-dim tiles with the same threshold said once
        runs: list[list[int]] = []
        for tile, keys in sorted(min_keys.items()):
            if runs and runs[-1][1] == keys:
                runs[-1][0] = tile
            else:
                runs.append([tile, keys])
        if len(runs) == 1:
            return f"from {runs[0][1]} keys"
        return ", ".join(f"from {keys} keys at head_dim <= {tile}" for tile, keys in runs)

    atomic, deterministic = _traits.BACKWARD_SM90_MIN_KEYS, _traits.BACKWARD_SM90_DETERMINISTIC_MIN_KEYS
    when = from_keys(atomic) + ("; deterministic calls too" if deterministic == atomic
                                else f"; deterministic: {from_keys(deterministic)}")
    return (f"float16/bfloat16: Hopper kernels {when} (no softcap, ALiBi or bias); "
            f"the others: tensor-core kernels (mma.sync). {describe_dq_apart()}")


def describe_dq_apart() -> str:
    """Which Hopper backward calls compute dQ in a kernel of its own (_traits.BACKWARD_SM90_DQ_APART_KEYS)."""
    parts = []
    previous = 0
    for tile, keys in sorted(_traits.BACKWARD_SM90_DQ_APART_KEYS.items()):
        dims = f"head_dim {previous + 1}-{tile}"
        previous = tile
        kinds = []
        for (deterministic, causal), limit in sorted(keys.items()):
            kinds.append(f"{'deterministic' if deterministic else 'atomic'} {'causal' if causal else 'non-causal'}"
                         + (" (any length)" if limit is None else f" up to {limit} keys"))
        if _traits.backward_sm90_dq_apart_every_call(tile):
            kinds = ["every call"]
        parts.append(f"{dims}: {', '.join(kinds)}")
    return "dQ in a kernel of its own (no window, no packed batch): " + "; ".join(parts)
