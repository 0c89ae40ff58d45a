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
import hashlib
import logging
import os
import re
import threading
from pathlib import Path

from . import _features, _traits
from ._dtypes import FP8_DTYPE
from ._params import cuda_struct

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
FP8_CTYPES = {FP8_DTYPE: "fa_e4m3"}   # the Hopper FP8 forward's e4m3 (uint8 bits with their descales)
OPTIONS = ()   # NVRTC options of every module beyond CuPy's own


def _kernel_dir() -> Path:
    # Source tree (kernels_cu/ beside the package) first, then the installed package data.
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "kernels_cu", here / "kernels_cu"):
        if (candidate / "common.cuh").is_file():
            return candidate
    raise FileNotFoundError(f"cupy_flash kernel sources not found next to {here}")


# The kernel families, one kernels_cu/<family>.cu each; a file names the headers it needs with
# #include "x.cuh" (each header with #pragma once), so each compiles on its own with NVRTC's
# in-memory headers or an include path.
FAMILIES = ("forward", "backward", "preprocess", "forward_tc", "backward_tc", "decode", "forward_sm90", "backward_sm90",
            "decode_sm90")
# The header written from Python (its one definition), which common.cuh includes: the feature bits,
# the configuration values and FlashParams (python -m cupy_flash source --interface prints it).
INTERFACE_HEADER = "flash_interface.cuh"
_INCLUDE = re.compile(r'^#include "([\w.]+)"\n', re.M)


def interface_header() -> str:
    return (f"// ---- feature bits (cupy_flash/_features.py) ----\n{_features.cuda_defines()}"
            f"\n// ---- configuration (cupy_flash/_traits.py) ----\n{_traits.cuda_defines()}"
            f"\n// ---- FlashParams (cupy_flash/_params.py) ----\n{cuda_struct()}")


@functools.lru_cache(maxsize=None)
def headers() -> dict:
    """{name: text} of every header a kernel file may include: kernels_cu's and the interface."""
    found = {path.name: path.read_text() for path in sorted(_kernel_dir().glob("*.cuh"))}
    return {INTERFACE_HEADER: interface_header(), **found}


def family_headers(family: str) -> tuple[str, ...]:
    """The headers ``family`` includes, directly or not, in the order they are expanded."""
    order = []

    def visit(text):
        for name in _INCLUDE.findall(text):
            if name not in order:
                order.append(name)
                visit(headers()[name])

    visit((_kernel_dir() / f"{family}.cu").read_text())
    return tuple(order)


@functools.lru_cache(maxsize=None)
def family_source(family: str) -> str:
    """``family``'s .cu file with its #includes expanded in place, each header once (what #pragma
    once does): the exact text that is compiled, as one string (CuPy's RawModule takes no headers),
    and hashed by the kernel caches, so an edit to any part recompiles."""
    expanded = set()

    def expand(name: str, text: str) -> str:
        def include(match):
            header = match.group(1)
            if header in expanded:
                return ""
            expanded.add(header)
            return expand(header, headers()[header])
        return f"// ---- {name} ----\n" + _INCLUDE.sub(include, text.replace("#pragma once\n", ""))

    return expand(f"{family}.cu", (_kernel_dir() / f"{family}.cu").read_text())


@dataclasses.dataclass(frozen=True)
class ModuleSpec:
    """One compiled module: a kernels_cu/<family>.cu file for one dtype and (except the row
    kernels) one head-dim tile; the tensor-core families also for one target (a tile table of
    _traits: sm8x, sm80, sm90, and sm90a for the Hopper family). A family of cupy_flash.families
    builds it (``families.module_spec``), naming the template instantiations to compile:
    ``kernels``, and the device variables its launcher reads, ``variables``."""

    family: str
    dtype: str
    tile: int | None = None
    target: str | None = None
    features: int = 0   # _features.FEATURE_* bits: the variant instantiations of the module
    # Tile arguments of the families that take them whole (the Hopper family's), part of the
    # module's identity.
    config: tuple = ()
    kernels: tuple[str, ...] = ()
    variables: tuple[str, ...] = ()

    @property
    def archs(self) -> tuple[str, ...]:
        """The architectures this module is built for (offline checks compile it for each): "sm_80",
        "sm_90", or "sm_90a" (Hopper's wgmma and setmaxnreg, which run on compute capability 9.0 only)."""
        return (_traits.TARGET_ARCH[self.target],) if self.target else ("sm_80", "sm_90")

    @property
    def arch_specific(self) -> bool:
        """Built for one architecture only (sm_90a): compiled here to a cubin for it, not by CuPy."""
        return any(arch.endswith("a") for arch in self.archs)

    @property
    def ctype(self) -> str:
        return CTYPES[self.dtype] if self.dtype in CTYPES else FP8_CTYPES[self.dtype]

    @property
    def name_expressions(self) -> tuple[str, ...]:
        """The kernels, then the device variables the launcher reads."""
        return self.kernels + self.variables

    def describe(self) -> str:
        tile = f", head_dim tile {self.tile}" if self.tile is not None else ""
        target = f", {self.target} tiles" if self.target else ""
        target += f" {'x'.join(str(x) for x in self.config)}" if self.config else ""
        features = f", {_features.describe(self.features)}" if self.features else ""
        return f"{self.family} kernels ({self.dtype}{tile}{target}{features})"


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
        module = _module(spec, device)
        function = module.get_function(name)   # compiles the module (or loads CuPy's cached cubin)
        if smem_bytes > 48 * 1024:
            function.max_dynamic_shared_size_bytes = smem_bytes
        _functions[key] = function
    return function


def _module(spec: ModuleSpec, device: int):
    """The loaded module of ``spec`` on ``device`` (call with _lock held)."""
    import cupy

    module = _modules.get((spec, device))
    if module is None:
        log.info("preparing %s on device %d: compiled on first use, then cached on disk", spec.describe(), device)
        if spec.arch_specific:
            module = ArchSpecificModule(spec)
        else:
            module = cupy.RawModule(code=family_source(spec.family), options=OPTIONS,
                                    name_expressions=spec.name_expressions)
        _modules[(spec, device)] = module
        record_in_index(spec)
    return module


def device_value(spec: ModuleSpec, expression: str) -> int:
    """The unsigned 32-bit value of a device variable of the module (a kernel's shared memory size,
    stated once, in CUDA: forward_sm90_smem_bytes)."""
    import cupy

    key = (spec, cupy.cuda.Device().id, expression)
    value = _values.get(key)
    if value is None:
        with _lock:
            value = _module(spec, key[1]).read_u32(expression)
            _values[key] = value
    return value


_values: dict = {}


class _Function:
    """A kernel of an ArchSpecificModule, callable as CuPy's RawKernel is, with its settable
    max_dynamic_shared_size_bytes (CuPy's plain Function has none)."""

    def __init__(self, function):
        self.function = function

    def __call__(self, grid, block, args, shared_mem=0):
        self.function(grid, block, args, shared_mem=shared_mem)

    @property
    def kernel(self):   # _launch's driver launch reads kernel.kernel.ptr, as of a RawKernel
        return self.function

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        from cupy.cuda import driver

        return driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, self.function.ptr)

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, value: int) -> None:
        from cupy.cuda import driver

        driver.funcSetAttribute(self.function.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, value)


class ArchSpecificModule:
    """A module for one architecture (sm_90a, which CuPy's compiler cannot name: it passes -arch as
    a number): compiled by NVRTC to a cubin with the offline check's options, cached beside CuPy's
    kernel cache under the hash of everything that enters it, and loaded with CuPy's Module."""

    def __init__(self, spec: ModuleSpec):
        import json

        from cupy.cuda import function

        (arch,) = spec.archs
        options = compile_options(arch, report=False)
        key = hashlib.sha1("\0".join((family_source(spec.family), " ".join(options), _nvrtc_version(),
                                       *sorted(spec.name_expressions))).encode()).hexdigest()
        directory = cache_dir()
        cubin_path, names_path = directory / f"cupy_flash_{key}.cubin", directory / f"cupy_flash_{key}.json"
        try:
            cubin, self.lowered = cubin_path.read_bytes(), json.loads(names_path.read_text())
        except (OSError, ValueError):
            cubin, self.lowered, _, _ = _nvrtc_compile(spec, options)
            try:
                directory.mkdir(parents=True, exist_ok=True)
                for path, data in ((cubin_path, cubin), (names_path, json.dumps(self.lowered).encode())):
                    temporary = path.with_suffix(f".{os.getpid()}.tmp")
                    temporary.write_bytes(data)
                    temporary.replace(path)
            except OSError as error:   # a read-only cache: compile again next process
                log.debug("cubin not cached: %s", error)
        self.module = function.Module()
        self.module.load(cubin)

    def get_function(self, name: str):
        return _Function(self.module.get_function(self.lowered[name]))

    def read_u32(self, expression: str) -> int:
        import cupy

        pointer = self.module.get_global_var(self.lowered[expression])
        memory = cupy.cuda.UnownedMemory(int(pointer), 4, self.module)
        return int(cupy.ndarray((1,), cupy.uint32, cupy.cuda.MemoryPointer(memory, 0)).get()[0])


# An index of the modules compiled on this machine, beside CuPy's kernel cache (whose files are
# named by hash only), so `python -m cupy_flash info` can say which are cached for this source.
INDEX_NAME = "cupy_flash_index.json"


def cache_dir() -> Path:
    from cupy.cuda import compiler

    default = getattr(compiler, "_default_cache_dir", os.path.expanduser("~/.cupy/kernel_cache"))
    return Path(os.environ.get("CUPY_CACHE_DIR", default))


def source_digest(family: str) -> str:
    return hashlib.sha1((family_source(family) + " ".join(OPTIONS)).encode()).hexdigest()[:12]


def read_index() -> dict:
    import json

    try:
        return json.loads((cache_dir() / INDEX_NAME).read_text())
    except (OSError, ValueError):
        return {}


def record_in_index(spec: ModuleSpec, arch: int | None = None) -> None:
    """Note ``spec`` as compiled for the device of compute capability ``arch`` (default: the current
    device's). Best effort: a read-only or shared cache directory only loses the listing."""
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


# ---------------------------------------------------------------------------------------------
# Offline: NVRTC without a GPU.

@dataclasses.dataclass
class KernelReport:
    name: str
    registers: int
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int
    # From the PTX: the launch bounds' block size (0 where the kernel declares none) and each
    # parameter's size in bytes, so tests can hold the launchers' block sizes and argument records
    # to the kernels'.
    max_threads: int = 0
    param_bytes: tuple[int, ...] = ()
    # Loads and stores through generic addresses (no state space in the PTX): in the Hopper
    # kernels, a sign that shared memory was reached through a pointer that lost its address space.
    generic_accesses: int = 0


@dataclasses.dataclass
class CompileReport:
    spec: ModuleSpec
    arch: str
    cubin_bytes: int
    kernels: list[KernelReport]
    log: str
    # {name expression: (registers, stack frame bytes)} read from the cubin itself; where ptxas's
    # report is missing (NVRTC 13 at times), ``kernels`` is built from it (see compile_offline).
    cubin_kernels: dict = dataclasses.field(default_factory=dict)
    from_cubin: bool = False

    @property
    def speed_warnings(self) -> list[str]:
        """ptxas warnings that cost speed silently: C7508 (setmaxnreg ignored), C7510-C7529 (wgmma
        serialised: register shortage, other instructions touching its registers in flight, or
        arrives / waits ptxas inserted on a divergent path, C7518-C7520)."""
        return [line.strip() for line in self.log.splitlines() if _SPEED_WARNING.search(line)]


_ENTRY = re.compile(r"Compiling entry function '(\S+)' for 'sm_\d+a?'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")
_SPEED_WARNING = re.compile(r"C75(0[89]|[12]\d)")
_PTX_PARAM = re.compile(r"\.param\s+(?:\.align\s+\d+\s+)?\.([busf])(\d+)\s+\S+?_param_\d+(?:\[(\d+)\])?")
_PTX_MAXNTID = re.compile(r"\.maxntid\s+(\d+),\s*(\d+),\s*(\d+)")
_PTX_MEMORY_ACCESS = re.compile(r"^\s*(?:@!?%p\d+\s+)?(?:ld|st)((?:\.[\w:]+)*)\s", re.M)
_PTX_STATE_SPACES = {"shared", "shared::cta", "shared::cluster", "global", "local", "param", "const"}


def _ptx_entries(ptx: str) -> dict:
    """{mangled kernel name: (launch-bound block size or 0, (parameter bytes, ...), generic loads and
    stores)} of a PTX text."""
    entries = {}
    for block in ptx.split(".entry ")[1:]:
        name = block.split("(", 1)[0].strip()
        signature, _, body = block.partition(")")
        params = tuple(int(count or 1) * int(bits) // 8 for _, bits, count in _PTX_PARAM.findall(signature))
        bound = _PTX_MAXNTID.search(body.split("{", 1)[0])
        generic = sum(1 for qualifiers in _PTX_MEMORY_ACCESS.findall(body)
                      if not _PTX_STATE_SPACES.intersection(qualifiers.split(".")))
        entries[name] = (int(bound.group(1)) * int(bound.group(2)) * int(bound.group(3)) if bound else 0, params, generic)
    return entries


def compile_options(arch: str, report: bool = True) -> tuple[str, ...]:
    """The options RawModule would use (CuPy's own include/standard flags plus ours, and the
    -ftz=true CuPy adds), targeting real hardware ``arch`` ("sm_80", "sm_90a"), with ptxas's
    resource report when ``report``."""
    from cupy._core import core

    return tuple(core.assemble_cupy_compiler_options(OPTIONS)) + (
        "-ftz=true", f"-arch={arch}") + (("-Xptxas=-v",) if report else ())


def _nvrtc_version() -> str:
    from cupy_backends.cuda.libs import nvrtc

    return ".".join(str(n) for n in nvrtc.getVersion())


def _nvrtc_compile(spec: ModuleSpec, options) -> tuple[bytes, dict, str, str]:
    """(cubin, {name expression: lowered name}, log, PTX) of ``spec`` compiled by NVRTC (no GPU needed)."""
    import struct

    from cupy_backends.cuda.libs import nvrtc

    program = nvrtc.createProgram(family_source(spec.family), f"{spec.family}.cu", [], [])
    try:
        for expression in spec.name_expressions:
            nvrtc.addNameExpression(program, expression)
        try:
            nvrtc.compileProgram(program, list(options))
        except nvrtc.NVRTCError as error:
            raise RuntimeError(f"NVRTC failed on {spec.describe()} with {' '.join(options)}:\n"
                               f"{nvrtc.getProgramLog(program)}") from error
        text = nvrtc.getProgramLog(program)
        lowered = {e: nvrtc.getLoweredName(program, e) for e in spec.name_expressions}
        cubin = nvrtc.getCUBIN(program)
        ptx = nvrtc.getPTX(program)
        ptx = ptx.decode(errors="replace") if isinstance(ptx, bytes) else ptx
    finally:
        nvrtc.destroyProgram(program)
    # CuPy's getCUBIN drops the image's last byte; the ELF header says how long it is (the program
    # headers end the file).
    program_headers, (entry_size, entries) = struct.unpack_from("<Q", cubin, 0x20)[0], struct.unpack_from("<HH", cubin, 0x36)
    end = program_headers + entry_size * entries
    if end > len(cubin):
        cubin += b"\0" * (end - len(cubin))
    return cubin, lowered, text, ptx


# The cubin's .nv.info attributes (EIATTR_*) that hold a kernel's resources, each (symbol index,
# value): its register count, and its stack frame (which holds any spill).
_EIATTR_REGCOUNT, _EIATTR_FRAME_SIZE = 0x2F, 0x11
_EIFMT_SVAL = 4


def cubin_resources(cubin: bytes) -> dict:
    """{mangled kernel name: (registers, stack frame bytes)} read from a cubin's ELF .nv.info
    section: the values ptxas's -v report prints, for an NVRTC that returns no report."""
    import struct

    section_offset = struct.unpack_from("<Q", cubin, 0x28)[0]
    entry_size, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, section_offset + i * entry_size) for i in range(count)]

    def string(table: int, offset: int) -> str:
        start = sections[table][4] + offset
        return cubin[start:cubin.index(0, start)].decode()

    by_name = {string(names_index, s[0]): s for s in sections}
    symtab = by_name[".symtab"]
    symbols = [string(symtab[6], struct.unpack_from("<I", cubin, symtab[4] + i * 24)[0])
               for i in range(symtab[5] // 24)]
    info = by_name[".nv.info"]
    registers, frames = {}, {}
    position, end = info[4], info[4] + info[5]
    while position < end:
        form, attribute, size = struct.unpack_from("<BBH", cubin, position)
        if form == _EIFMT_SVAL and attribute in (_EIATTR_REGCOUNT, _EIATTR_FRAME_SIZE):
            symbol, value = struct.unpack_from("<II", cubin, position + 4)
            (registers if attribute == _EIATTR_REGCOUNT else frames)[symbols[symbol]] = value
        position += 4 + (size if form == _EIFMT_SVAL else 0)
    return {name: (count, frames.get(name, 0)) for name, count in registers.items()}


def compile_offline(spec: ModuleSpec, arch: str, ptxas_report: bool = True) -> CompileReport:
    """Compile every instantiation of ``spec`` to a cubin for ``arch`` with NVRTC (no GPU needed);
    without ``ptxas_report``, as an NVRTC that gives none, the kernels' figures come from the cubin."""
    cubin, lowered_names, text, ptx = _nvrtc_compile(spec, compile_options(arch, ptxas_report))
    entries = _ptx_entries(ptx)
    lowered = {name: expression for expression, name in lowered_names.items()}
    kernels = []
    for block in text.split("Compiling entry function")[1:]:
        block = "Compiling entry function" + block
        entry = _ENTRY.search(block)
        frame = _FRAME.search(block)
        regs = _REGS.search(block)
        if not (entry and frame and regs):
            continue
        max_threads, param_bytes, generic_accesses = entries.get(entry.group(1), (0, (), 0))
        kernels.append(KernelReport(
            name=lowered.get(entry.group(1), entry.group(1)),
            registers=int(regs.group(1)),
            stack_bytes=int(frame.group(1)),
            spill_store_bytes=int(frame.group(2)),
            spill_load_bytes=int(frame.group(3)),
            max_threads=max_threads,
            param_bytes=param_bytes,
            generic_accesses=generic_accesses,
        ))
    resources = cubin_resources(cubin)
    cubin_kernels = {expression: resources[name] for expression, name in lowered_names.items() if name in resources}
    from_cubin = not kernels
    if from_cubin:
        # No ptxas report (seen with NVRTC 13): the cubin's registers and stack frame stand in. A
        # spill lives in the stack frame, so the frame bounds both spill figures.
        for expression, (registers, frame) in cubin_kernels.items():
            max_threads, param_bytes, generic_accesses = entries.get(lowered_names[expression], (0, (), 0))
            kernels.append(KernelReport(name=expression, registers=registers, stack_bytes=frame,
                                        spill_store_bytes=frame, spill_load_bytes=frame, max_threads=max_threads,
                                        param_bytes=param_bytes, generic_accesses=generic_accesses))
    return CompileReport(spec=spec, arch=arch, cubin_bytes=len(cubin), kernels=kernels, log=text,
                         cubin_kernels=cubin_kernels, from_cubin=from_cubin)


def _compile_case(case):
    spec, arch = case
    try:
        return case, compile_offline(spec, arch)
    except Exception as error:  # handed back to the caller with its case
        return case, error


ALL_ARCHS = ("sm_80", "sm_90", "sm_90a")


def compile_all_offline(specs, archs=ALL_ARCHS, workers=None, progress=None) -> dict:
    """Compile ``specs`` (families.all_module_specs(): every module) for each of its archs among ``archs``, in parallel
    worker processes; ``progress(done, total, case)`` is called as each finishes.
    Returns {(spec, arch): CompileReport or the exception raised}. Workers are spawned, not
    forked: the caller may already run CUDA or JAX threads, which a fork can deadlock."""
    import concurrent.futures
    import multiprocessing

    cases = [(spec, arch) for spec in specs for arch in archs if arch in spec.archs]
    # The slowest first (the Hopper modules take longest): fewer workers idle at the end.
    cases.sort(key=lambda case: not case[0].arch_specific)
    workers = max(1, min(len(cases), workers or os.cpu_count() or 1))
    context = multiprocessing.get_context("spawn")
    reports = {}
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        for done, future in enumerate(concurrent.futures.as_completed([pool.submit(_compile_case, c) for c in cases]), 1):
            case, report = future.result()
            reports[case] = report
            if progress is not None:
                progress(done, len(cases), case)
    # Seen with NVRTC 13 on the device (not 12.9): a module compiled in a parallel worker came back
    # with its cubin but an empty ptxas log. Compile such modules again here, one at a time (the
    # log also carries the speed warnings).
    for case, report in reports.items():
        if isinstance(report, CompileReport) and report.from_cubin:
            reports[case] = _compile_case(case)[1]
    return reports
