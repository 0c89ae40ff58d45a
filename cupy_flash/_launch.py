"""How a plan's kernels go out: parameters packed once, the driver's launch, early launches.

A plan (forward.ForwardPlan, backward.BackwardPlan, decode.DecodePlan) holds everything of a call
but the arrays' addresses. ``packed_once`` packs its kernels' parameters (params records, tensor
maps, tile counters) once per set of addresses, stream and host thread, into a ``Packed`` whose
``run`` is the launches alone, through CuPy's binding of ``cuLaunchKernel``; ``ready_stream`` says
whether a repeated call may take that short path at all; ``kept`` and ``cached`` are the package's
bounded caches. A plan launches on addresses, so the adapters run it on their frameworks' buffers.

Early launches (Hopper's programmatic dependent launch): CuPy's launch API has no launch
attributes, so a kernel launched ``early`` goes through the driver's ``cuLaunchKernelEx`` (ctypes,
libcuda) with ``programmaticStreamSerializationAllowed``: its blocks may become resident while the
kernel before it in the stream still runs (from when every block of that kernel has executed
``griddepcontrol.launch_dependents``, or exited), and they must execute ``griddepcontrol.wait``
(common.cuh's ``wait_for_predecessor``) before they touch global memory: it returns once the
predecessor has completed and its writes are visible. What is gained is the launch and the block
start-up (a few microseconds), hidden behind the predecessor's tail; results are the same bit for
bit.

Only kernels that call ``wait_for_predecessor`` before their first global access may be launched
early, or (the Hopper backward's main kernel behind its dQ kernel) kernels that touch nothing the
predecessor writes and call it before they end, so that the stream's later work still sees the
predecessor's writes: there the gain is the predecessor's tail, its last blocks' SMs taken by the
early kernel's blocks as they free. Elsewhere (before sm_90, no libcuda entry, ``CUPY_FLASH_PDL=0``,
a launch the driver refuses) the launch is an ordinary one.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import os
import sys
import threading
import typing

import numpy

from ._streams import as_cupy_stream

# CUlaunchAttributeID CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (cuda.h)
_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _LaunchAttribute(ctypes.Structure):
    # CUlaunchAttribute: the id, padding to 8 bytes, a 64-byte value union whose first member
    # here is programmaticStreamSerializationAllowed (an int).
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("value_rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):
    # CUlaunchConfig
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_mem_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


def environment_reader(name: str):
    """() -> the environment variable ``name``'s value or None, read afresh on each call (a test or a
    benchmark may set it between calls) for the repeated calls' short paths: ``os.environ.get``
    encodes the name and decodes the value (~0.7 us on a CPU host, a third of the forward's plan
    key); CPython's os.environ keeps its encoded dict in ``_data``, which its writes (monkeypatch's
    too) update, so here the name is encoded once and an unset variable costs one dict lookup."""
    data, encode = getattr(os.environ, "_data", None), getattr(os.environ, "encodekey", None)
    if not isinstance(data, dict) or encode is None:
        return functools.partial(os.environ.get, name)
    encoded, get = encode(name), data.get

    def read():
        return None if get(encoded) is None else os.environ.get(name)

    return read


_pdl_variable = environment_reader("CUPY_FLASH_PDL")   # "0": no early launches


def driver_function(name: str):
    """The CUDA driver library's function ``name`` through ctypes (argument types still to set),
    or None where the library or the function is missing (no driver, an old one)."""
    library = _driver_library()
    return getattr(library, name, None) if library is not None else None


@functools.lru_cache(maxsize=None)
def _driver_library():
    try:
        return ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")
    except OSError:
        return None


class _EarlyLaunches:
    """libcuda's cuLaunchKernelEx (CUDA 12.0+ drivers) as a ctypes function without argument types:
    Packed builds its arguments once as ctypes objects, which pass as they are (0.4 us a call
    against 0.9 with argtypes converting them, on a CPU host). ``entry`` is None until the first
    early launch, then the function or False (missing); ``refused``: the driver refused an early
    launch once, so ordinary launches from then on."""

    entry = None
    refused = False


def _launched_early(arguments: tuple) -> bool:
    """Whether cuLaunchKernelEx with ``arguments`` (Packed's: the config, the function, the
    kernelParams, no extra) launched a kernel early: where early launches are allowed and the
    driver has the entry, and the driver took it (a refusal turns them off from then on). False:
    the caller launches it the ordinary way. (Whether the device supports them is the plan's to
    know: Packed's ``early`` is false before sm_90.)"""
    if _EarlyLaunches.refused or _pdl_variable() == "0":
        return False
    entry = _EarlyLaunches.entry
    if entry is None:
        library = _driver_library()
        entry = _EarlyLaunches.entry = (library["cuLaunchKernelEx"] if library is not None
                                        and hasattr(library, "cuLaunchKernelEx") else False)
    if entry is False:
        return False
    if _launch_ex(entry, arguments) == 0:
        return True
    _EarlyLaunches.refused = True
    return False


@functools.lru_cache(maxsize=None)
def supports_early(device: int) -> bool:
    """Whether kernels on ``device`` may be launched early (programmatic dependent launch: sm_90+)."""
    import cupy

    return int(cupy.cuda.Device(device).compute_capability) >= 90


def kept(cache: dict, key, value, limit: int = 256):
    """``value``, stored in ``cache`` under ``key``: the one bound of the package's caches (plans,
    tensor maps, launch parameters, views). Past ``limit`` keys (shapes and buffers come and go) the
    cache starts again rather than grow."""
    if len(cache) >= limit:
        cache.clear()
    cache[key] = value
    return value


def cached(cache: dict, key, make, limit: int = 256):
    """``cache[key]``, made by ``make()`` the first time (kept). Keys name everything that enters the
    value (a tensor map's addresses, shapes, strides and box; packed_once's), so repeated calls on
    the same buffers (a training loop) make nothing, and memory the pool hands out again finds its
    value."""
    value = cache.get(key)
    return kept(cache, key, make(), limit) if value is None else value


def packed_once(cache: dict, addresses: tuple, stream: int, capturing: bool, pack):
    """A plan's packed launches (``pack()``, a Packed for the stream at ``stream``) for its arrays
    at ``addresses``: packed once per those addresses, the stream and the host thread (the Hopper
    kernels' tile counter is per thread and stream: TileCounters), everything else in them being
    the plan's. Under graph capture (``capturing``) packed afresh and not kept: a captured launch
    takes a tile counter of its own. At most 32 sets a plan (a training loop's calls find a few;
    each set holds ~1-4 KB of records and maps, and up to 256 plans are kept)."""
    if capturing:
        return pack()
    key = addresses + (stream, threading.get_ident())
    packed = cache.get(key)
    return kept(cache, key, pack(), limit=32) if packed is None else packed


class CudaCalls:
    """The CuPy functions a repeated call makes, looked up once: a plan holds them (a function's
    own ``import cupy`` costs ~0.5 us of host time a call, and the short paths would make several)."""

    def __init__(self):
        import cupy
        from cupy.cuda import driver, runtime

        self.get_device = runtime.getDevice
        self.is_capturing = runtime.streamIsCapturing   # (stream) -> bool
        self.current_stream = cupy.cuda.get_current_stream
        self.alloc = cupy.cuda.alloc                    # (bytes) -> MemoryPointer, CuPy's allocator
        self.empty = new_array_maker(cupy)              # (shape, dtype) -> a new C-contiguous cupy.ndarray
        self.memset = runtime.memsetAsync               # (address, value, bytes, stream)
        self.launch = driver.launchKernel


def new_array_maker(cupy):
    """(shape, dtype, memptr=None) -> a new C-contiguous ``cupy.ndarray`` from CuPy's current
    allocator (or over ``memptr``), what ``cupy.ndarray(shape, dtype, memptr)`` makes. Since CuPy
    13, ``cupy.ndarray`` is a Python subclass of the Cython ``_ndarray_base`` whose ``__new__``
    takes ``*args`` and calls ``_init``: calling the two directly costs an output pair (o, lse)
    3.35 us on the H100's host against 4.05 for ``ndarray(shape, dtype, cupy.cuda.alloc(n))``
    (which also measures the memory's bounds) and 5.35 for ``cupy.empty`` (docs/performance.md,
    host time). Where the layout is not that one (another CuPy), ``cupy.ndarray``."""
    ndarray = cupy.ndarray
    base = getattr(getattr(cupy._core, "core", None), "_ndarray_base", None)
    new, init = getattr(base, "__new__", None), getattr(base, "_init", None)
    if base is None or init is None or ndarray.__mro__[1:2] != (base,) or "__array_finalize__" in vars(base):
        return ndarray

    def empty(shape, dtype, memptr=None):
        array = new(ndarray)
        init(array, shape, dtype, memptr)
        return array

    return empty


@functools.lru_cache(maxsize=None)
def cuda_calls() -> CudaCalls:
    return CudaCalls()


FLOAT32 = numpy.dtype(numpy.float32)


def aligned_offsets(sizes) -> tuple[tuple[int, ...], int]:
    """Offsets of buffers of ``sizes`` bytes laid one after another in one allocation, each at a
    256-byte boundary, and the bytes they span with the last one rounded up too (a plan's outputs,
    the backward's temporaries, decode's partials)."""
    offsets, total = [], 0
    for nbytes in sizes:
        offsets.append(total)
        total += -(-nbytes // 256) * 256
    return tuple(offsets), total


def nbytes_of(shape, dtype) -> int:
    """The bytes of a C-contiguous array of ``shape`` and ``dtype``."""
    return math.prod(shape) * numpy.dtype(dtype).itemsize


class OutputAndLse:
    """Base of the forward's and decode's plans: their outputs, o (q's shape with v's head_dim, and
    q's dtype) and lse (float32), new on each call from one allocation of CuPy's (o, then lse at
    the next 256 bytes): one pool call where two cost ~1 us more of host time (docs/decisions.md,
    host path). Each holds the allocation until both are gone."""

    def plan_outputs(self, o, lse_shape: tuple) -> None:
        """``o``: an array (or stand-in) of o's shape and dtype."""
        self.o_shape, self.o_dtype, self.lse_shape = tuple(o.shape), o.dtype, lse_shape
        lse_bytes = nbytes_of(lse_shape, FLOAT32)
        (_, self.lse_offset), _ = aligned_offsets((nbytes_of(self.o_shape, o.dtype), lse_bytes))
        self.outputs_bytes = self.lse_offset + lse_bytes

    def outputs(self):
        cuda = self.cuda
        memory = cuda.alloc(self.outputs_bytes)
        empty = cuda.empty
        return empty(self.o_shape, self.o_dtype, memory), empty(self.lse_shape, FLOAT32, memory + self.lse_offset)


def ready_stream(plan, stream: int | None = None) -> int | None:
    """The stream (a cudaStream_t: ``stream``, or CuPy's current one) on which ``plan`` (one with
    ``cuda`` and ``device``) may launch as it is, or None: its device must be the current one (its
    kernels belong to it) and the stream must not be capturing a graph (the checked route keeps a
    capture's temporaries alive; the legacy default stream, 0, never captures). The repeated calls'
    short paths ask this first."""
    cuda = plan.cuda
    if cuda.get_device() != plan.device:
        return None
    if stream is None:
        stream = cuda.current_stream().ptr
    return None if stream and cuda.is_capturing(stream) else stream


# A short call's workspace (the backward's row statistics and dQ accumulator, the split decode's
# partials) of at most this many bytes is one kept per (device, host thread, stream) rather than a
# new allocation (~1 us of host time; a PyTorch tensor's ~3): the calls on one stream run one after
# another, early launches included (the rule above), so a call's kernels find the previous call's
# done with it. Larger workspaces belong to calls whose GPU time dwarfs an allocation, and are not
# held between calls.
KEPT_WORKSPACE_BYTES = 4 << 20
_workspaces: dict = {}   # (device, host thread, stream) -> a kept workspace (a CuPy array of bytes)


def kept_workspace(nbytes: int, device: int, stream: int):
    """A workspace of ``nbytes`` (<= KEPT_WORKSPACE_BYTES; a CuPy array of bytes, which the caller
    holds until its launches are out) kept for this host thread's launches on the stream at
    ``stream`` on ``device`` (the current device; not a capturing stream: a graph holds its own).
    It grows to the largest size asked for; it comes from CuPy's own pool with the stream current,
    so the pool orders its reuse on that stream when the cache lets one go (kept's bound)."""
    key = (device, threading.get_ident(), stream)
    workspace = _workspaces.get(key)
    if workspace is None or workspace.nbytes < nbytes:
        workspace = kept(_workspaces, key, _pool_bytes(nbytes, stream))
    return workspace


def short_call_workspace(nbytes: int, device: int, stream: int, allocate) -> tuple:
    """A short call's workspace of ``nbytes`` on the stream at ``stream`` (not capturing): (its
    address, what holds it, which the caller holds until its launches are out). Up to
    KEPT_WORKSPACE_BYTES the one kept for the stream; larger, ``allocate(nbytes)``, an object with
    ``ptr`` or ``data_ptr()``."""
    if nbytes <= KEPT_WORKSPACE_BYTES:
        held = kept_workspace(nbytes, device, stream)
        return held.data.ptr, held
    held = allocate(nbytes)
    return (held.ptr if hasattr(held, "ptr") else held.data_ptr()), held


def _pool_bytes(nbytes: int, stream: int):
    """``nbytes`` bytes from CuPy's default pool (whatever allocator the caller set: the PyTorch
    adapter routes allocations into PyTorch's, whose CUDA-graph pools hold nothing past a call) for
    use on the stream at ``stream``."""
    import cupy

    with cupy.cuda.using_allocator(cupy.get_default_memory_pool().malloc), as_cupy_stream(stream):
        return cupy.empty((max(nbytes, 1),), dtype=cupy.uint8)


class Launch(typing.NamedTuple):
    """One kernel of a plan, as its family describes it: ``name`` is its template instantiation
    (what tests see through ``recording``), ``record`` the params record it takes (a plan's
    records by name), ``maps`` which of the plan's tensor-map sets it takes (None: none), ``early``
    whether it may be launched early (Hopper's programmatic dependent launch)."""

    name: str
    kernel: object
    grid: int
    threads: int
    smem: int = 0
    record: str = "main"
    maps: int | None = None
    early: bool = False


@contextlib.contextmanager
def recording():
    """Inside, the plans' launches are noted: yields the list of (family, (kernel name, ...)) of each
    Packed's launches, in order (a backward call has two: the preprocess, then the rest). For tests:
    it swaps Packed.run for the block (every thread's launches), so launches outside one pay nothing."""
    launched, run = [], Packed.run

    def noting_run(packed) -> None:
        launched.append(packed.names)
        run(packed)

    Packed.run = noting_run
    try:
        yield launched
    finally:
        Packed.run = run


def current_stream() -> tuple[int, bool]:
    """(CuPy's current stream as a cudaStream_t, whether it is capturing a graph): what a plan's
    launch needs to know of the stream."""
    cuda = cuda_calls()
    stream = cuda.current_stream().ptr
    return stream, cuda.is_capturing(stream)


def kernel_parameters(arguments: tuple):
    """cuLaunchKernel's ``kernelParams`` for ``arguments`` (ctypes objects, each holding the bytes of
    one by-value parameter: a params record, tensor maps, a pointer): an array of their addresses
    that holds them, so a launch plan may keep it and launch with it again."""
    parameters = (ctypes.c_void_p * len(arguments))(*(ctypes.addressof(a) for a in arguments))
    parameters.arguments = arguments
    return parameters


class Packed:
    """A call's launches with their parameters packed for one stream: each (CUfunction, grid,
    threads, shared memory bytes, kernelParams address, the early launch's arguments or None,
    kernelParams) from (kernel, grid, threads, shared memory, arguments, early), after ``zeroed``
    ((address, bytes) set to zero first). The arrays of addresses (and configs) are held here, so
    the addresses stay valid as long as this does. ``early``: a programmatic dependent launch where
    the driver allows (the plan passes it only on sm_90+).

    Run a second time (the same arrays, stream and host thread: packed_once found it), the launches
    are captured once into a CUDA graph, and from then on ``run`` is that graph's one launch:
    cudaGraphLaunch costs 2.2-2.7 us of host time for one to three kernels against 4-5 us for each
    kernel launched (docs/decisions.md, host path: graphs). The kernels, their parameters and their
    order are the same, so the results are the same bit for bit; what a graph gives up is the early
    start of its first kernel behind the work before it in the stream (the early launches inside
    it stay early). ``CUPY_FLASH_GRAPHS=0`` (read when a graph would be captured) keeps the
    launches one by one."""

    __slots__ = ("launches", "stream", "launch", "names", "zeroed", "has_early", "_runs", "_graph")

    def __init__(self, launches, stream: int, names: tuple = (), zeroed: tuple = ()):
        self.launch = cuda_calls().launch
        self.names = names   # (family, (kernel name, ...)): what recording() notes
        self.zeroed = zeroed
        packed = []
        for kernel, grid, threads, shared_mem, arguments, early in launches:
            parameters = kernel_parameters(arguments)
            function = kernel.kernel.ptr
            early_arguments = _early_arguments(function, grid, threads, shared_mem, stream, parameters) if early else None
            packed.append((function, grid, threads, shared_mem, ctypes.addressof(parameters), early_arguments,
                           parameters))
        self.launches, self.stream = tuple(packed), stream
        self.has_early = any(launch[5] is not None for launch in packed)
        self._runs = 0
        self._graph = None   # a _Graph once captured; False: launched one by one

    def run(self) -> None:
        """The launches on the stream: the captured graph's launch where there is one (and it was
        captured with the early launches as they are allowed now), else each memset and kernel in
        turn, through CuPy's bindings of the driver's calls (cuLaunchKernel: 3.8-5 us of host time
        against a ctypes call's 5.6 on the H100's host; CuPy's kernel call converts its arguments
        again on every call); a second run captures the graph."""
        graph = self._graph
        if graph and (not self.has_early or graph.early == _early_allowed()):
            graph.launch(self.stream)
            return
        self._launch_each(self.stream, None)
        if graph is None:
            self._runs += 1
            if self._runs == GRAPH_AFTER_RUNS:
                self._graph = _captured(self)

    def _launch_each(self, stream: int, capture_early) -> None:
        """Each memset and kernel on ``stream`` in turn: the packed stream, or (capturing a graph)
        another, for which ``capture_early`` makes an early launch's arguments."""
        memset = cuda_calls().memset
        for address, nbytes in self.zeroed:
            memset(address, 0, nbytes, stream)
        launch = self.launch
        for function, grid, threads, shared_mem, address, early_arguments, parameters in self.launches:
            if early_arguments is not None:
                if capture_early is not None:
                    early_arguments = capture_early(function, grid, threads, shared_mem, stream, parameters)
                if _launched_early(early_arguments):
                    continue
            launch(function, grid, 1, 1, threads, 1, 1, shared_mem, stream, address, 0)


# A Packed is captured into a graph on its second run (its first may be the only one: a shape or a
# buffer seen once pays no capture, ~20-60 us).
GRAPH_AFTER_RUNS = 2
_graphs_variable = environment_reader("CUPY_FLASH_GRAPHS")   # "0": no graphs


def _early_allowed() -> bool:
    """Whether an early launch would be tried now (not refused, not turned off)."""
    return not _EarlyLaunches.refused and _pdl_variable() != "0"


class _Graph:
    """An instantiated CUDA graph (cudaGraphExec_t), uploaded for its stream, destroyed with this
    object (the driver frees one still running when it completes). ``early``: whether its capture
    launched early the kernels that may be."""

    __slots__ = ("executable", "early", "launch", "destroy")

    def __init__(self, executable: int, early: bool):
        from cupy.cuda import runtime

        self.executable, self.early = executable, early
        self.launch = functools.partial(runtime.graphLaunch, executable)   # (stream)
        self.destroy = runtime.graphExecDestroy

    def __del__(self):
        with contextlib.suppress(Exception):
            self.destroy(self.executable)


_capture_streams: dict = {}   # (device, host thread) -> the stream graphs are captured on


def _captured(packed: Packed):
    """``packed``'s launches captured into a CUDA graph (a _Graph) from a stream of this host
    thread's own, or False where graphs are turned off or the capture failed (the launches then go
    one by one, as before)."""
    if _graphs_variable() == "0":
        return False
    import cupy
    from cupy.cuda import runtime

    device = runtime.getDevice()
    key = (device, threading.get_ident())
    side = _capture_streams.get(key)
    if side is None:
        side = kept(_capture_streams, key, cupy.cuda.Stream(non_blocking=True))
    early = _early_allowed()
    try:
        runtime.streamBeginCapture(side.ptr, runtime.streamCaptureModeThreadLocal)
    except Exception:
        return False
    launched = False
    try:
        packed._launch_each(side.ptr, _early_arguments)
        launched = True
    except Exception:
        pass
    finally:
        try:
            graph = runtime.streamEndCapture(side.ptr)
        except Exception:
            graph = None
    if graph is None:
        return False
    try:
        if not launched or (packed.has_early and early != _early_allowed()):
            return False
        executable = runtime.graphInstantiate(graph)
    except Exception:
        return False
    finally:
        runtime.graphDestroy(graph)
    captured = _Graph(executable, early)
    try:
        runtime.graphUpload(executable, packed.stream)
    except Exception:
        return False
    return captured


def _early_arguments(function: int, grid: int, threads: int, shared_mem: int, stream: int, parameters) -> tuple:
    """cuLaunchKernelEx's arguments for a launch on ``stream`` with programmatic stream serialisation
    allowed, as ctypes objects (built once per packed launch): a reference to its CUlaunchConfig
    (which holds the attribute it points to), the CUfunction, the kernelParams, no extra."""
    attribute = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
    config = _LaunchConfig(grid, 1, 1, threads, 1, 1, shared_mem, stream, ctypes.pointer(attribute), 1)
    config.attribute = attribute
    return ctypes.byref(config), ctypes.c_void_p(function), parameters, None


def _launch_ex(entry, arguments: tuple) -> int:
    """cuLaunchKernelEx (``entry``) with _early_arguments' ``arguments``: its CUresult."""
    return entry(*arguments)


class TileCounters:
    """Tile counters of a persistent kernel's launches (kernels_cu/sm90_tma.cuh, TileCounter: `nbytes`,
    its size as the module states it, zero at launch, which the kernel leaves zero). Launches of one
    host thread on one stream run one after another, so they share one counter, zeroed once. A
    launch being captured into a graph gets its own, zeroed in the graph: a graph may replay on any
    stream, beside direct calls."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self._counters: dict = {}   # (host thread, stream) -> counter

    def address(self, stream: int, capturing: bool) -> int:
        """A counter's address for a launch on the stream at ``stream`` (``capturing``: it is
        capturing a graph). A captured launch's counter comes from CuPy's allocator and is noted
        for the call (_streams.record_kernel_arrays), so it lives as long as the call's outputs."""
        from ._streams import record_kernel_arrays

        if capturing:
            counter = self._zeroed(stream)
            record_kernel_arrays((counter,))
            return counter.data.ptr
        key = (threading.get_ident(), stream)
        counter = self._counters.get(key)
        if counter is None:
            counter = self._counters[key] = self._zeroed(stream, kept=True)
        return counter.data.ptr

    def _zeroed(self, stream: int, kept: bool = False):
        """A new counter, zeroed on the launches' stream. One ``kept`` across calls comes from CuPy's
        own pool whatever allocator the caller set: the PyTorch adapter routes allocations into
        PyTorch's, and a CUDA-graph pool of PyTorch's may hold nothing past a call (torch.compile's
        reduce-overhead warms up inside one, and refused the counter kept there: "tensor(s) in the
        cudagraph pool not tracked as outputs")."""
        import cupy

        pool = cupy.cuda.using_allocator(cupy.get_default_memory_pool().malloc) if kept else contextlib.nullcontext()
        with pool:
            counter = cupy.empty((self.nbytes,), dtype=cupy.uint8)
        cupy.cuda.runtime.memsetAsync(counter.data.ptr, 0, counter.nbytes, stream)
        return counter
