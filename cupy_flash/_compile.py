"""Kernel sources, their template instantiations, and compilation.

One module is compiled per (kernel family, dtype, head-dim tile): a first call compiles only the
instantiations it needs (a few seconds), CuPy caches the binary on disk, and this process keeps the
loaded module. ``compile_offline`` compiles the same source with the same options through NVRTC's
low-level bindings, which needs no GPU: CI uses it to build every instantiation and read ptxas's
register and spill report.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
import threading
from pathlib import Path

from . import _features, _traits
from ._params import PARAMS_DTYPE

log = logging.getLogger("cupy_flash")
if not log.handlers:
    # One line per first compile, visible by default so a first call never looks like a hang;
    # silence with logging.getLogger("cupy_flash").setLevel(logging.WARNING) or CUPY_FLASH_QUIET=1.
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("cupy_flash: %(message)s"))
    log.addHandler(_handler)
    log.setLevel(logging.WARNING if os.environ.get("CUPY_FLASH_QUIET") else logging.INFO)
    log.propagate = False

TENSOR_CORE_DTYPES = ("float16", "bfloat16")
CTYPES = {"float16": "fa_f16", "bfloat16": "fa_bf16", "float32": "float"}
OPTIONS = (f"-DFLASH_PARAMS_BYTES={PARAMS_DTYPE.itemsize}",)


def _kernel_dir() -> Path:
    # Source tree (kernels_cu/ beside the package) first, then the installed package data.
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "kernels_cu", here / "kernels_cu"):
        if (candidate / "common.cuh").is_file():
            return candidate
    raise FileNotFoundError(f"cupy_flash kernel sources not found next to {here}")


# Headers each family's source is prefixed with (NVRTC gets one string: no include path needed).
TENSOR_CORE_FAMILIES = ("forward_tc", "backward_tc", "decode")


@functools.lru_cache(maxsize=None)
def family_source(family: str) -> str:
    """common.cuh (and tensor_core.cuh for the tensor-core families) followed by the family's .cu
    file: the exact text that is compiled (and hashed by CuPy's cache, so any edit recompiles)."""
    directory = _kernel_dir()
    headers = ("common.cuh", "tensor_core.cuh") if family in TENSOR_CORE_FAMILIES else ("common.cuh",)
    parts = [f"// ---- {name} ----\n{(directory / name).read_text()}" for name in headers + (f"{family}.cu",)]
    return "\n".join(parts)


def _flag(value: bool) -> str:
    return "true" if value else "false"


@dataclasses.dataclass(frozen=True)
class ModuleSpec:
    """One compiled module: a kernel family for one dtype and (except preprocess) one head-dim tile;
    the tensor-core families also for one target (a tile table of _traits: sm8x, sm80, sm90)."""

    family: str
    dtype: str
    tile: int | None = None
    target: str | None = None
    features: int = 0   # _features.FEATURE_* bits: the variant instantiations of the module

    def __post_init__(self):
        if self.family in ("backward", "backward_tc"):   # the backward kernels never see the sink
            object.__setattr__(self, "features", self.features & ~_features.FORWARD_ONLY_FEATURES)
        if self.family == "decode":
            object.__setattr__(self, "features", self.features & _features.DECODE_FEATURES)

    @property
    def archs(self) -> tuple[int, ...]:
        """The architectures this module is built for (offline checks compile it for each)."""
        return (_traits.TARGET_ARCH[self.target],) if self.target else (80, 90)

    @property
    def ctype(self) -> str:
        return CTYPES[self.dtype]

    def forward_kernel(self, causal: bool) -> str:
        block_m, block_n = _traits.FORWARD_BLOCKS[self.tile]
        return (f"flash_forward_kernel<{self.ctype}, {self.tile}, {block_m}, {block_n}, {_flag(causal)}, "
                f"{self.features}>")

    def forward_tc_kernel(self, causal: bool) -> str:
        block_n, num_warps, m_tiles = _traits.forward_tc_config(self.tile, self.target)
        return (f"flash_forward_tc_kernel<{self.ctype}, {self.tile}, {block_n}, {num_warps}, {m_tiles}, "
                f"{_flag(causal)}, {self.features}>")

    def backward_tc_kernel(self, causal: bool) -> str:
        config = ", ".join(str(x) for x in _traits.backward_tc_config(self.tile, self.target))
        return f"flash_backward_tc_kernel<{self.ctype}, {self.tile}, {config}, {_flag(causal)}, {self.features}>"

    def backward_kernel(self, causal: bool, atomic_dq: bool) -> str:
        block_m, block_n = _traits.BACKWARD_BLOCKS[self.tile]
        return (f"flash_backward_kernel<{self.ctype}, {self.tile}, {block_m}, {block_n}, "
                f"{_flag(causal)}, {_flag(atomic_dq)}, {self.features}>")

    def backward_dq_kernel(self, causal: bool) -> str:
        block_m, block_n = _traits.BACKWARD_BLOCKS[self.tile]
        return (f"flash_backward_dq_kernel<{self.ctype}, {self.tile}, {block_m}, {block_n}, {_flag(causal)}, "
                f"{self.features}>")

    def decode_kernel(self, causal: bool) -> str:
        return (f"flash_decode_kernel<{self.ctype}, {self.tile}, {_traits.DECODE_WARPS}, {_flag(causal)}, "
                f"{self.features}>")

    def append_kernel(self) -> str:
        return f"flash_append_kernel<{self.ctype}>"

    def combine_kernel(self, partial_dtype: str) -> str:
        return f"flash_combine_kernel<{CTYPES[partial_dtype]}, {self.ctype}>"

    def dq_convert_kernel(self) -> str:
        return f"flash_dq_convert_kernel<{self.ctype}>"

    def preprocess_kernel(self) -> str:
        return f"flash_preprocess_kernel<{self.ctype}>"

    def kv_group_sum_kernel(self) -> str:
        return f"flash_kv_group_sum_kernel<{self.ctype}>"

    @property
    def name_expressions(self) -> tuple[str, ...]:
        if self.family == "forward":
            return tuple(self.forward_kernel(c) for c in (False, True))
        if self.family == "forward_tc":
            return tuple(self.forward_tc_kernel(c) for c in (False, True))
        if self.family == "backward_tc":
            return tuple(self.backward_tc_kernel(c) for c in (False, True))
        if self.family == "preprocess":
            return (self.preprocess_kernel(), self.dq_convert_kernel(), self.kv_group_sum_kernel())
        if self.family == "backward":
            return (tuple(self.backward_kernel(c, a) for c in (False, True) for a in (False, True))
                    + tuple(self.backward_dq_kernel(c) for c in (False, True)))
        if self.family == "decode":
            if self.tile is not None:
                return tuple(self.decode_kernel(c) for c in (False, True))
            # Row kernels: the combine of split partials (float32) and of merge_attention_states'
            # inputs (the dtype itself); the append for the tensor-core dtypes flash_decode takes.
            partials = ("float32",) if self.dtype == "float32" else ("float32", self.dtype)
            append = (self.append_kernel(),) if self.dtype in TENSOR_CORE_DTYPES else ()
            return append + tuple(self.combine_kernel(d) for d in partials)
        raise ValueError(f"unknown kernel family {self.family!r}")

    def describe(self) -> str:
        tile = f", head_dim tile {self.tile}" if self.tile is not None else ""
        target = f", {self.target} tiles" if self.target else ""
        features = f", {_features.describe(self.features)}" if self.features else ""
        return f"{self.family} kernels ({self.dtype}{tile}{target}{features})"


# The feature sets CI builds besides the plain one: every flag that can be combined at once. bias
# and varlen exclude each other (the API refuses the pair), so the two largest reachable sets.
LARGEST_FEATURE_SETS = (_features.ALL_FEATURES & ~_features.FEATURE_VARLEN,
                        _features.ALL_FEATURES & ~_features.FEATURE_BIAS)


def all_module_specs(features=(0,) + LARGEST_FEATURE_SETS) -> list[ModuleSpec]:
    """The modules CI's compile check builds: every plain module the package can compile, and the
    same with the largest combinations of feature flags (each flag's code is independent of the
    others', so the combinations cover them; 2^6 feature sets per module would be too many to
    build in CI)."""
    specs = []
    for dtype in CTYPES:
        specs.append(ModuleSpec("preprocess", dtype))
        specs.append(ModuleSpec("decode", dtype))
        for tile in _traits.HEAD_DIM_TILES:
            for flags in features:
                specs.append(ModuleSpec("forward", dtype, tile, features=flags))
                if dtype in TENSOR_CORE_DTYPES:
                    for target in _traits.TARGET_ARCH:
                        specs.append(ModuleSpec("forward_tc", dtype, tile, target, flags))
                        specs.append(ModuleSpec("backward_tc", dtype, tile, target, flags))
                    specs.append(ModuleSpec("decode", dtype, tile, features=flags))
                else:   # the CUDA-core backward runs float32 only
                    specs.append(ModuleSpec("backward", dtype, tile, features=flags))
    return list(dict.fromkeys(specs))   # the decode family keeps fewer flags: equal specs once


# ---------------------------------------------------------------------------------------------
# Run time: cupy.RawModule, one per (spec, device), compiled on first use.

_lock = threading.Lock()
_modules: dict = {}
_functions: dict = {}


def get_kernel(spec: ModuleSpec, name: str, smem_bytes: int = 0):
    """The compiled kernel ``name`` (one of spec.name_expressions) on the current device, with its
    dynamic shared memory limit raised to ``smem_bytes`` where that exceeds the 48 KB default."""
    import cupy

    device = cupy.cuda.Device().id
    key = (spec, device, name)
    function = _functions.get(key)
    if function is not None:
        return function
    with _lock:
        module = _modules.get((spec, device))
        new_module = module is None
        if new_module:
            log.info("preparing %s on device %d: compiled on first use, then cached on disk",
                     spec.describe(), device)
            module = cupy.RawModule(code=family_source(spec.family), options=OPTIONS,
                                    name_expressions=spec.name_expressions)
            _modules[(spec, device)] = module
        function = module.get_function(name)   # compiles the module (or loads CuPy's cached cubin)
        if new_module:
            record_in_index(spec)
        if smem_bytes > 48 * 1024:
            function.max_dynamic_shared_size_bytes = smem_bytes
        _functions[key] = function
    return function


# An index of the modules compiled on this machine, beside CuPy's kernel cache (whose files are
# named by hash only), so `python -m cupy_flash info` can say which are cached for this source.
INDEX_NAME = "cupy_flash_index.json"


def cache_dir() -> Path:
    from cupy.cuda import compiler

    default = getattr(compiler, "_default_cache_dir", os.path.expanduser("~/.cupy/kernel_cache"))
    return Path(os.environ.get("CUPY_CACHE_DIR", default))


def source_digest(family: str) -> str:
    import hashlib

    return hashlib.sha1((family_source(family) + " ".join(OPTIONS)).encode()).hexdigest()[:12]


def read_index() -> dict:
    import json

    try:
        return json.loads((cache_dir() / INDEX_NAME).read_text())
    except (OSError, ValueError):
        return {}


def record_in_index(spec: ModuleSpec, arch: int | None = None) -> None:
    """Note ``spec`` as compiled for ``arch`` (default: the current device's). Best effort: a
    read-only or shared cache directory only loses the listing."""
    import json
    import time

    if arch is None:
        import cupy

        arch = int(cupy.cuda.Device().compute_capability)
    try:
        index = read_index()
        index[f"{spec.describe()} sm_{arch}"] = dict(family=spec.family, digest=source_digest(spec.family),
                                                     arch=arch, when=time.strftime("%Y-%m-%d %H:%M"))
        path = cache_dir() / INDEX_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(index, indent=1, sort_keys=True))
        temporary.replace(path)
    except OSError as error:
        log.debug("kernel index not written: %s", error)


def tensor_core_target() -> str:
    """The tensor-core kernels' tile table for the current device (_traits.tensor_core_target)."""
    import cupy

    return _tensor_core_target(cupy.cuda.Device().id)


@functools.lru_cache(maxsize=None)
def _tensor_core_target(device: int) -> str:
    import cupy

    runtime = cupy.cuda.runtime
    smem = runtime.deviceGetAttribute(runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin, device)
    return _traits.tensor_core_target(int(cupy.cuda.Device(device).compute_capability), smem)


# ---------------------------------------------------------------------------------------------
# Offline: NVRTC without a GPU.

@dataclasses.dataclass
class KernelReport:
    name: str
    registers: int
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int


@dataclasses.dataclass
class CompileReport:
    spec: ModuleSpec
    arch: int
    cubin_bytes: int
    kernels: list[KernelReport]
    log: str


_ENTRY = re.compile(r"Compiling entry function '(\S+)' for 'sm_\d+a?'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


def offline_options(arch: int) -> tuple[str, ...]:
    """The options RawModule would use (CuPy's own include/standard flags plus ours, and the
    -ftz=true CuPy adds), targeting real hardware sm_<arch>, with ptxas's resource report."""
    from cupy._core import core

    return tuple(core.assemble_cupy_compiler_options(OPTIONS)) + (
        "-ftz=true", f"-arch=sm_{arch}", "-Xptxas=-v")


def compile_offline(spec: ModuleSpec, arch: int) -> CompileReport:
    """Compile every instantiation of ``spec`` to a cubin for sm_<arch> with NVRTC (no GPU needed)."""
    from cupy_backends.cuda.libs import nvrtc

    program = nvrtc.createProgram(family_source(spec.family), f"{spec.family}.cu", [], [])
    try:
        for expression in spec.name_expressions:
            nvrtc.addNameExpression(program, expression)
        try:
            nvrtc.compileProgram(program, list(offline_options(arch)))
        except nvrtc.NVRTCError as error:
            raise RuntimeError(f"NVRTC failed on {spec.describe()} for sm_{arch}:\n"
                               f"{nvrtc.getProgramLog(program)}") from error
        text = nvrtc.getProgramLog(program)
        lowered = {nvrtc.getLoweredName(program, e): e for e in spec.name_expressions}
        cubin = nvrtc.getCUBIN(program)
    finally:
        nvrtc.destroyProgram(program)

    kernels = []
    for block in text.split("Compiling entry function")[1:]:
        block = "Compiling entry function" + block
        entry = _ENTRY.search(block)
        frame = _FRAME.search(block)
        regs = _REGS.search(block)
        if not (entry and frame and regs):
            continue
        kernels.append(KernelReport(
            name=lowered.get(entry.group(1), entry.group(1)),
            registers=int(regs.group(1)),
            stack_bytes=int(frame.group(1)),
            spill_store_bytes=int(frame.group(2)),
            spill_load_bytes=int(frame.group(3)),
        ))
    return CompileReport(spec=spec, arch=arch, cubin_bytes=len(cubin), kernels=kernels, log=text)


def _compile_case(case):
    spec, arch = case
    try:
        return case, compile_offline(spec, arch)
    except Exception as error:  # handed back to the caller with its case
        return case, error


def compile_all_offline(archs=(80, 90), specs=None, workers=None) -> dict:
    """Compile ``specs`` (default: every module) for each of its archs among ``archs``, in parallel
    worker processes.
    Returns {(spec, arch): CompileReport or the exception raised}. Workers are spawned, not
    forked: the caller may already run CUDA or JAX threads, which a fork can deadlock."""
    import concurrent.futures
    import multiprocessing

    cases = [(spec, arch) for spec in (specs or all_module_specs()) for arch in archs if arch in spec.archs]
    workers = max(1, min(len(cases), workers or os.cpu_count() or 1))
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        reports = dict(pool.map(_compile_case, cases))
    # Seen with NVRTC 13 on the device (not 12.9): a module compiled in a parallel worker came back
    # with its cubin but an empty ptxas log. Compile such modules again here, one at a time.
    for case, report in reports.items():
        if isinstance(report, CompileReport) and not report.kernels:
            reports[case] = _compile_case(case)[1]
    return reports
