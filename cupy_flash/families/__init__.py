"""Kernel families: which compiled kernels a call runs on this GPU, and the registry of them.

A family is one object per kernel file pair with everything of it the launch code needs: which
calls it ``supports``, its tile table, its module specs (the instantiations to compile), and its
launches (grid, threads, shared memory, tensor maps). The plans (forward.forward_plan, backward.backward_plan,
decode.decode_plan) ask the registry and contain no family branches.

    sm90.Forward, sm90.Backward     Hopper (wgmma, TMA, warp specialisation; sm_90a): float16 and
                                    bfloat16 on compute capability 9.0 (families/sm90.py)
    tensor_core.Forward, .Backward  mma.sync (sm_80+): float16 and bfloat16 everywhere else
    cuda_core.Forward, .Backward    CUDA cores: float32
    decode, rows                    the decode kernel, the append and combine; the backward's row kernels

The forward takes the first of FORWARD that supports a call, the backward the first of BACKWARD.
``CUPY_FLASH_KERNELS=portable`` (or ``use_kernels("portable")``) keeps calls off the Hopper family.
Adding a family: its module here, and its line in FORWARD / BACKWARD and MODULES.
"""

from __future__ import annotations

from .. import _features, _launch
from .._checks import AttentionShape
from .._compile import CTYPES
from . import cuda_core, decode, rows, sm90, tensor_core
from ._base import (
    KERNELS_VARIABLE,
    SETTINGS,
    BackwardSchedule,
    DeviceInfo,
    check_smem,
    current_device,
    current_device_id,
    device_info,
    kernels_setting,
    use_kernels,
)

__all__ = ["KERNELS_VARIABLE", "SETTINGS", "BackwardSchedule", "DeviceInfo", "check_smem", "current_device",
           "current_device_id", "device_info",
           "kernels_setting", "use_kernels", "FORWARD", "BACKWARD", "forward_family", "backward_family",
           "all_module_specs", "recording"]

FORWARD = (sm90.Forward, tensor_core.Forward, cuda_core.Forward)
BACKWARD = (sm90.Backward, tensor_core.Backward, cuda_core.Backward)
# The modules of every family, each a function (dtype, feature sets) -> the ModuleSpecs CI builds.
MODULES = (rows.module_specs, decode.module_specs, cuda_core.module_specs, tensor_core.module_specs,
           sm90.module_specs)


def forward_family(device: DeviceInfo, shape, variant, setting: str | None = None, arrays=()):
    """The forward family a call runs: the first of FORWARD that supports it (``arrays``: the
    kernel-ready q, k, v, or empty to ask about the shapes alone)."""
    setting = kernels_setting() if setting is None else setting
    return next(family for family in FORWARD if family.supports(device, shape, variant, setting, arrays))


def backward_family(device: DeviceInfo, shape, variant, deterministic: bool = False, arrays=(),
                    setting: str | None = None):
    """The backward family a call runs: the first of BACKWARD that supports it (``arrays``: the
    inputs the Hopper kernels' tensor maps read, q, k, v, do)."""
    setting = kernels_setting() if setting is None else setting
    return next(family for family in BACKWARD if family.supports(device, shape, variant, setting, arrays, deterministic))


recording = _launch.recording   # with families.recording() as launched: (family, kernel names) of each launch


# The feature sets CI builds besides the plain one: every flag that can be combined at once. bias
# and varlen exclude each other (the API refuses the pair), so the two largest reachable sets.
LARGEST_FEATURE_SETS = (_features.ALL_FEATURES & ~_features.FEATURE_VARLEN,
                        _features.ALL_FEATURES & ~_features.FEATURE_BIAS)


def all_module_specs(features=(0,) + LARGEST_FEATURE_SETS) -> list:
    """The modules CI's compile check builds: every plain module the package can compile, and the
    same with the largest combinations of feature flags (each flag's code is independent of the
    others', so the combinations cover them; 2^6 feature sets per module would be too many to
    build in CI)."""
    specs = [spec for dtype in CTYPES for module_specs in MODULES for spec in module_specs(dtype, features)]
    specs += sm90.fp8_module_specs(features)
    return list(dict.fromkeys(specs))   # the decode family keeps fewer flags: equal specs once


FAMILY_DESCRIPTIONS = {"forward_sm90": "Hopper kernels (wgmma, TMA, warp specialisation; sm_90a)",
                       "forward_tc": "tensor-core kernels (mma.sync; sm_80+)",
                       "forward": "CUDA-core kernels"}


def describe_forward(device: DeviceInfo, setting: str | None = None) -> list[str]:
    """What ``python -m cupy_flash info`` says of a GPU: the forward family of each kind of call."""
    setting = kernels_setting() if setting is None else setting
    lines = []
    for dtype in ("bfloat16", "float16", "float32"):
        shape = AttentionShape(1, 1024, 1024, 8, 128, dtype)
        plain = forward_family(device, shape, _features.check_variant(1, 8, False), setting).name
        line = f"{dtype}: {FAMILY_DESCRIPTIONS[plain]}"
        if plain == "forward_sm90":
            line += f"; with a bias: {FAMILY_DESCRIPTIONS['forward_tc']}"
        lines.append(line)
    if setting == "portable":
        lines.append(f"({KERNELS_VARIABLE}=portable: the Hopper kernels are off)")
    return lines


def describe_backward(device: DeviceInfo, setting: str | None = None) -> str:
    """The float16/bfloat16 backward's kernels on a GPU, as ``python -m cupy_flash info`` says it."""
    setting = kernels_setting() if setting is None else setting
    shape = AttentionShape(1, 16384, 16384, 8, 128, "bfloat16")
    if backward_family(device, shape, _features.check_variant(1, 8, False), setting=setting) is not sm90.Backward:
        return "float16/bfloat16: tensor-core kernels (mma.sync; sm_80+)"
    if setting == "experimental":
        return (f"float16/bfloat16: Hopper kernels (head_dim <= {max(sm90.BACKWARD_SM90)}; no softcap, ALiBi or bias; "
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

    atomic, deterministic = sm90.BACKWARD_SM90_MIN_KEYS, sm90.BACKWARD_SM90_DETERMINISTIC_MIN_KEYS
    when = from_keys(atomic) + ("; deterministic calls too" if deterministic == atomic
                                else f"; deterministic: {from_keys(deterministic)}")
    return (f"float16/bfloat16: Hopper kernels {when} (head_dim <= {max(sm90.BACKWARD_SM90)}; no softcap, ALiBi or "
            f"bias); the others: tensor-core kernels (mma.sync). {describe_dq_apart()}")


def describe_dq_apart() -> str:
    """Which Hopper backward calls compute dQ in a kernel of its own (sm90.BACKWARD_SM90_DQ_APART_KEYS)."""
    ranges = []   # [first head_dim, last head_dim, what], neighbouring tiles alike merged
    previous = 0
    for tile, keys in sorted(sm90.BACKWARD_SM90_DQ_APART_KEYS.items()):
        kinds = []
        for (deterministic, causal), limit in sorted(keys.items()):
            kinds.append(f"{'deterministic' if deterministic else 'atomic'} {'causal' if causal else 'non-causal'}"
                         + (" (any length)" if limit is None else f" up to {limit} keys"))
        if sm90.backward_sm90_dq_apart_every_call(tile):
            kinds = ["every call"]
        what = ", ".join(kinds)
        if ranges and ranges[-1][2] == what:
            ranges[-1][1] = tile
        else:
            ranges.append([previous + 1, tile, what])
        previous = tile
    parts = [f"head_dim {first}-{last}: {what}" for first, last, what in ranges]
    return "dQ in a kernel of its own (no window, no packed batch): " + "; ".join(parts)
