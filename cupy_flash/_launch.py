"""Launches that may start before their predecessor ends: Hopper's programmatic dependent launch.

CuPy's launch API has no launch attributes, so a kernel launched ``early`` goes through the
driver's ``cuLaunchKernelEx`` (ctypes, libcuda) with ``programmaticStreamSerializationAllowed``:
its blocks may become resident while the kernel before it in the stream still runs (from when
every block of that kernel has executed ``griddepcontrol.launch_dependents``, or exited), and
they must execute ``griddepcontrol.wait`` (common.cuh's ``wait_for_predecessor``) before they
touch global memory: it returns once the predecessor has completed and its writes are visible.
What is gained is the launch and the block start-up (a few microseconds), hidden behind the
predecessor's tail; results are the same bit for bit.

Only kernels that call ``wait_for_predecessor`` before their first global access may be launched
early, or (the Hopper backward's main kernel behind its dQ kernel) kernels that touch nothing the
predecessor writes and call it before they end, so that the stream's later work still sees the
predecessor's writes: there the gain is the predecessor's tail, its last blocks' SMs taken by the
early kernel's blocks as they free. Elsewhere (before sm_90, no libcuda entry, ``CUPY_FLASH_PDL=0``,
a launch the driver refuses) the launch is an ordinary one.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import threading

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


def enabled() -> bool:
    """Early launches unless CUPY_FLASH_PDL=0 (read on each call: a test or a benchmark may flip it)."""
    return os.environ.get("CUPY_FLASH_PDL", "1") != "0"


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


@functools.lru_cache(maxsize=None)
def _driver_entry():
    """libcuda's cuLaunchKernelEx (CUDA 12.0+ drivers), or None."""
    entry = driver_function("cuLaunchKernelEx")
    if entry is None:
        return None
    entry.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                      ctypes.POINTER(ctypes.c_void_p)]
    entry.restype = ctypes.c_int
    return entry


@functools.lru_cache(maxsize=None)
def _device_supports(device: int) -> bool:
    import cupy

    return int(cupy.cuda.Device(device).compute_capability) >= 90


_refused = threading.Event()   # the driver refused an early launch once: ordinary launches from then on


def launch(kernel, grid: tuple, block: tuple, argument, shared_mem: int = 0, *, early: bool = False) -> None:
    """kernel(grid, block, (argument,), shared_mem=...) with ``argument`` one NumPy record (the
    params struct, passed by value); ``early``: a programmatic dependent launch where possible."""
    if early and _launched_early(lambda entry: _launch_early(entry, kernel, grid, block, argument, shared_mem)):
        return
    kernel(grid, block, (argument,), shared_mem=shared_mem)


def _launched_early(launch_with) -> bool:
    """Whether ``launch_with(entry)`` (cuLaunchKernelEx's entry -> its CUresult) launched a kernel
    early: where early launches are allowed and supported, and the driver took it (a refusal
    turns them off from then on). False: the caller launches it the ordinary way."""
    import cupy

    if not enabled() or _refused.is_set():
        return False
    entry = _driver_entry()
    if entry is None or not _device_supports(cupy.cuda.Device().id):
        return False
    if launch_with(entry) == 0:
        return True
    _refused.set()
    return False


@functools.lru_cache(maxsize=None)
def _plain_entry():
    """libcuda's cuLaunchKernel, or None."""
    entry = driver_function("cuLaunchKernel")
    if entry is None:
        return None
    u32 = ctypes.c_uint
    entry.argtypes = [ctypes.c_void_p, u32, u32, u32, u32, u32, u32, u32, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                      ctypes.c_void_p]
    entry.restype = ctypes.c_int
    return entry


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


def packed_once(cache: dict, addresses: tuple, pack):
    """A plan's launch parameters for its arrays at ``addresses``: ``pack()`` once per those
    addresses, the current stream and the host thread (the Hopper kernels' tile counter is per
    thread and stream: TileCounters), everything else in them being the plan's. Under graph
    capture packed afresh and not kept: a captured launch takes a tile counter of its own.
    At most 32 sets a plan (a training loop's calls find a few; each set holds ~1-4 KB of records
    and maps, and up to 256 plans are kept)."""
    import cupy

    stream = cupy.cuda.get_current_stream()
    if stream.is_capturing():
        return pack()
    return cached(cache, addresses + (stream.ptr, threading.get_ident()), pack, limit=32)


def kernel_parameters(arguments: tuple):
    """cuLaunchKernel's ``kernelParams`` for ``arguments`` (ctypes objects, each holding the bytes of
    one by-value parameter: a params record, tensor maps, a pointer): an array of their addresses
    that holds them, so a launch plan may keep it and launch with it again."""
    parameters = (ctypes.c_void_p * len(arguments))(*(ctypes.addressof(a) for a in arguments))
    parameters.arguments = arguments
    return parameters


def launch_buffers(kernel, grid: int, threads: int, shared_mem: int, parameters, *, early: bool = False) -> None:
    """kernel((grid,), (threads,), arguments) on the current stream, ``parameters`` being
    kernel_parameters(arguments), through the driver's cuLaunchKernel: CuPy's launch converts its
    NumPy arguments again on every call (a third of a cached forward's host time on the H100's
    host). Without libcuda's entry, CuPy's launch. ``early``: a programmatic dependent launch where
    possible (as ``launch``)."""
    import cupy

    if early and _launched_early(lambda entry: _launch_ex(entry, kernel, (grid,), (threads,), shared_mem, parameters)):
        return
    entry = _plain_entry()
    if entry is None:
        kernel((grid,), (threads,), tuple(_as_numpy(a) for a in parameters.arguments), shared_mem=shared_mem)
        return
    result = entry(kernel.kernel.ptr, grid, 1, 1, threads, 1, 1, shared_mem, cupy.cuda.get_current_stream().ptr,
                   parameters, None)
    if result != 0:
        raise RuntimeError(f"cuLaunchKernel failed with CUDA error {result} (grid {grid}, {threads} threads, "
                           f"{shared_mem} bytes of shared memory)")


def _as_numpy(value):
    import numpy

    size = ctypes.sizeof(value)
    return numpy.frombuffer(ctypes.string_at(ctypes.addressof(value), size), dtype=numpy.dtype((numpy.void, size)))


def _launch_early(entry, kernel, grid, block, argument, shared_mem) -> int:
    parameters = (ctypes.c_void_p * 1)(argument.ctypes.data)   # the struct's bytes, copied at launch
    return _launch_ex(entry, kernel, grid, block, shared_mem, parameters)


def _launch_ex(entry, kernel, grid, block, shared_mem, parameters) -> int:
    """cuLaunchKernelEx with programmatic stream serialisation allowed: its CUresult."""
    import cupy

    grid, block = tuple(grid) + (1,) * (3 - len(grid)), tuple(block) + (1,) * (3 - len(block))
    attribute = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
    config = _LaunchConfig(*grid, *block, shared_mem, cupy.cuda.get_current_stream().ptr,
                           ctypes.pointer(attribute), 1)
    return entry(ctypes.byref(config), kernel.kernel.ptr, parameters, None)


class TileCounters:
    """Tile counters of a persistent kernel's launches (kernels_cu/sm90_tma.cuh, TileCounter: `nbytes`,
    its size as the module states it, zero at launch, which the kernel leaves zero). Launches of one
    host thread on one stream run one after another, so they share one counter, zeroed once. A
    launch being captured into a graph gets its own, zeroed in the graph: a graph may replay on any
    stream, beside direct calls."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self._counters: dict = {}   # (host thread, stream) -> counter

    def address(self) -> int:
        """A counter's address for a launch on the current stream."""
        import cupy

        from ._streams import record_kernel_arrays

        stream = cupy.cuda.get_current_stream()
        if stream.is_capturing():
            counter = cupy.empty((self.nbytes,), dtype=cupy.uint8)
            cupy.cuda.runtime.memsetAsync(counter.data.ptr, 0, counter.nbytes, stream.ptr)
            record_kernel_arrays((counter,))
            return counter.data.ptr
        key = (threading.get_ident(), stream.ptr)
        counter = self._counters.get(key)
        if counter is None:
            counter = self._counters[key] = cupy.zeros((self.nbytes,), dtype=cupy.uint8)
        return counter.data.ptr
