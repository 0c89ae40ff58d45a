"""A Python function as an XLA custom call, through XLA's FFI C API read with ctypes (imported by the
JAX adapter only; nothing to build).

``jax.ffi`` registers handlers by C function pointer; a ctypes callback is one. XLA calls it at
each execution with a call frame (``xla/ffi/api/c_api.h``): the stream comes from the API's
``XLA_FFI_Stream_Get``, the buffers' addresses from the frame, and the Python function launches
the kernels there. It replaces ``jax.experimental.buffer_callback``, whose compiled handler hands
Python a buffer object per operand, each asked for its address through
``__cuda_array_interface__``: the adapter's jitted forward 80.6 -> 76.0 us a call, forward +
backward 151.5 -> 141.9 (H200 host, one process; docs/decisions.md, Host path and adapters).

One target, ``cupy_flash_call`` on CUDA (``cupy_flash_call_cpu`` on the host platform for tests);
an int64 attribute ``callback`` names the Python function (kept in ``_callbacks`` for the
process's life, one per traced call).

Layouts read (FFI API 0.1+; offsets are the C structs' on 64-bit hosts; a frame whose
``struct_size`` does not reach the attrs is refused with an error):
- XLA_FFI_CallFrame: struct_size, extension_start, api, ctx, stage (int, padded), then the args,
  rets and attrs structs of 5 words each (struct_size, extension_start, size, types, pointers).
- XLA_FFI_Buffer: struct_size, extension_start, dtype (int, padded), data, rank, dims.
- XLA_FFI_Scalar (an attribute): dtype (int, padded), value.
"""

from __future__ import annotations

import ctypes
import struct
import sys
import threading

import numpy

# The package's name (cupy_flash_call): another copy of the package imported under another name (a
# benchmark's baseline tree) registers a handler of its own rather than collide with this one's.
TARGET = __name__.rpartition(".")[0].replace(".", "_") + "_call"

# XLA_FFI_DataType -> numpy dtype name (xla_data.proto's PrimitiveType numbers).
_DTYPES = {1: "bool", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "uint8", 7: "uint16", 8: "uint32",
           9: "uint64", 10: "float16", 11: "float32", 12: "float64", 16: "bfloat16", 20: "float8_e4m3fn"}
_EXECUTE = 3                      # XLA_FFI_ExecutionStage_EXECUTE
_METADATA = 1                     # XLA_FFI_Extension_Metadata
_FRAME_WORDS = 21                 # XLA_FFI_CallFrame up to attrs: 168 bytes
_FRAME = struct.Struct(f"{_FRAME_WORDS}Q")
_STREAM_GET, _DEVICE_ORDINAL_GET = 80, 184   # offsets of the two functions in XLA_FFI_Api
_ERROR_CREATE = 48
_API_SIZE_WITH_ORDINAL = 192
_INTERNAL = 13                    # XLA_FFI_Error_Code_INTERNAL

_callbacks: dict = {}
_lock = threading.Lock()
_registered: set = set()
_handlers: list = []               # the ctypes handlers, alive for the process's life


class Buffer:
    """One of XLA's buffers in a call: its device address, shape and dtype (numpy; the FP8 dtype as
    ml_dtypes' name), and the device it lives on."""

    __slots__ = ("pointer", "shape", "dtype", "device")

    def __init__(self, pointer: int, shape: tuple, dtype, device: int):
        self.pointer, self.shape, self.dtype, self.device = pointer, shape, dtype, device


class Call:
    """One execution of the custom call: XLA's stream (0 on the CPU platform), and the addresses of
    the inputs' and outputs' buffers in order; ``inputs_described`` / ``outputs_described`` give
    Buffer objects (shapes and dtypes read from the frame)."""

    __slots__ = ("stream", "inputs", "outputs", "_frame", "_words", "_api")

    def shape(self, index: int) -> tuple:
        """Input ``index``'s dimensions."""
        return _shape(_word(self._words[0] + 8 * index))

    @property
    def device(self) -> int:
        return _device_ordinal(self._api, self._frame)

    def inputs_described(self) -> tuple:
        return _described(self._words[0], len(self.inputs), self.device)

    def outputs_described(self) -> tuple:
        return _described(self._words[1], len(self.outputs), self.device)


def python_call(callback, results, *, input_output_aliases=None, vmap_method=None, platform: str = "CUDA"):
    """``jax.ffi.ffi_call`` of ``callback(call: Call)`` with ``results`` (ShapeDtypeStructs): a
    function of the input arrays returning the outputs, as ``buffer_callback`` makes one. The target
    exists for ``platform`` alone ("CUDA"; "cpu": host buffers, for tests), so XLA refuses a call
    placed elsewhere when it compiles it, before anything runs."""
    import jax

    target = _register(jax, platform)
    with _lock:
        index = len(_callbacks)
        _callbacks[index] = callback
    call = jax.ffi.ffi_call(target, results, input_output_aliases=input_output_aliases, vmap_method=vmap_method)
    attribute = numpy.int64(index)
    return lambda *arrays: call(*arrays, callback=attribute)


_TARGETS = {"CUDA": TARGET, "cpu": TARGET + "_cpu"}


def _register(jax, platform: str) -> str:
    """The target's name on ``platform``, its handler registered once."""
    target = _TARGETS[platform]
    with _lock:
        if platform not in _registered:
            handler = _HANDLER(_make_handler(platform == "CUDA"))
            _handlers.append(handler)
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(ctypes.cast(handler, ctypes.c_void_p)),
                                        platform=platform)
            _registered.add(platform)
    return target


_HANDLER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)


def _make_handler(on_gpu: bool):
    frame_words, word, memory, callbacks = _FRAME.unpack_from, _WORD.unpack_from, _MEMORY, _callbacks

    def handle(frame: int):
        try:
            words = frame_words(memory, frame - 1)
            if words[1]:   # an extension: XLA asking for the handler's metadata
                return _answer_metadata(words[1])
            if words[4] & 0xFFFFFFFF != _EXECUTE:
                return None
            if words[0] < _FRAME.size:
                raise RuntimeError(f"XLA's call frame has {words[0]} bytes; cupy_flash reads {_FRAME.size} (its FFI API)")
            call = Call()
            call._frame, call._api, call._words = frame, words[2], (words[9], words[14])
            call.inputs = _data_pointers(words[9], words[7])
            call.outputs = _data_pointers(words[14], words[12])
            call.stream = _stream(words[2], words[3]) if on_gpu else 0
            scalar = word(memory, words[20] - 1)[0]   # attrs[0], the only one: an XLA_FFI_Scalar
            callbacks[word(memory, word(memory, scalar + 7)[0] - 1)[0]](call)
            return None
        except BaseException as error:   # noqa: BLE001 - raised to XLA, which raises it in the caller
            return _error(frame, f"{type(error).__name__}: {error}")

    return handle


# The process's memory as one read-only byte view starting at address 1 (no NULL base): XLA's
# structs are read with struct.unpack_from at (address - 1), a C call per struct, where ctypes'
# from_address builds an object per field (several times the host time a call).
_MEMORY = memoryview((ctypes.c_ubyte * (sys.maxsize - 1)).from_address(1)).toreadonly()
_WORD = struct.Struct("Q")
_ARRAYS: dict = {}


def _words(address: int, count: int) -> tuple:
    """``count`` 64-bit words at ``address`` (none read where count is 0)."""
    if not count:
        return ()
    layout = _ARRAYS.get(count)
    if layout is None:
        layout = _ARRAYS[count] = struct.Struct(f"{count}Q")
    return layout.unpack_from(_MEMORY, address - 1)


def _data_pointers(pointers: int, count: int) -> tuple:
    """The data addresses (each XLA_FFI_Buffer's fourth word) of the ``count`` buffers that the
    array at ``pointers`` points to (none: the array may be NULL, which is not read)."""
    word, memory = _WORD.unpack_from, _MEMORY
    return tuple([word(memory, buffer + 23)[0] for buffer in _words(pointers, count)])


def _word(address: int) -> int:
    return _WORD.unpack_from(_MEMORY, address - 1)[0]


def _int32(address: int) -> int:
    return struct.unpack_from("i", _MEMORY, address - 1)[0]


def _shape(buffer: int) -> tuple:
    rank = _word(buffer + 32)
    return struct.unpack_from(f"{rank}q", _MEMORY, _word(buffer + 40) - 1) if rank else ()


def _described(pointers: int, count: int, device: int) -> tuple:
    import ml_dtypes  # noqa: F401 - numpy learns bfloat16 and float8_e4m3fn

    described = []
    for buffer in _words(pointers, count):
        dtype = numpy.dtype(_DTYPES[_int32(buffer + 16)])
        described.append(Buffer(_word(buffer + 24), _shape(buffer), dtype, device))
    return tuple(described)


class _StreamGetArgs(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("ctx", ctypes.c_void_p), ("stream", ctypes.c_void_p)]


class _DeviceOrdinalGetArgs(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("ctx", ctypes.c_void_p), ("device_ordinal", ctypes.c_int32)]


class _ErrorCreateArgs(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("message", ctypes.c_char_p), ("errc", ctypes.c_int)]


# API functions by address, kept (the API table is XLA's, fixed for the process). PYFUNCTYPE: the
# GIL stays held, so one argument struct per function serves every thread.
_API_CALL = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)
_functions: dict = {}


def _function(api: int, offset: int):
    key = (api, offset)
    function = _functions.get(key)
    if function is None:
        function = _functions[key] = _API_CALL(_word(api + offset))
    return function


_stream_args = _StreamGetArgs(ctypes.sizeof(_StreamGetArgs), None, None, None)
_stream_args_address = ctypes.addressof(_stream_args)


def _stream(api: int, context: int) -> int:
    _stream_args.ctx = context
    error = _function(api, _STREAM_GET)(_stream_args_address)
    if error:
        raise RuntimeError("XLA_FFI_Stream_Get failed")
    return _stream_args.stream or 0


def _device_ordinal(api: int, frame: int) -> int:
    if _word(api) >= _API_SIZE_WITH_ORDINAL:
        args = _DeviceOrdinalGetArgs(ctypes.sizeof(_DeviceOrdinalGetArgs), None, _word(frame + 24), 0)
        if not _function(api, _DEVICE_ORDINAL_GET)(ctypes.addressof(args)):
            return int(args.device_ordinal)
    import cupy  # an older API: the device of the first buffer's memory

    buffer = _word(_word(frame + 72))
    return int(cupy.cuda.runtime.pointerGetAttributes(_word(buffer + 24)).device)


def _answer_metadata(extension: int):
    """Fill XLA_FFI_Metadata_Extension's metadata: API version 0.1, no traits (so XLA never runs
    the call inside a command buffer, where a Python launch could not be captured)."""
    if _int32(extension + 8) == _METADATA:
        metadata = _word(extension + 24)
        # XLA_FFI_Metadata: struct_size, XLA_FFI_Api_Version (struct_size, extension_start, major,
        # minor), traits.
        ctypes.c_int32.from_address(metadata + 24).value = 0
        ctypes.c_int32.from_address(metadata + 28).value = 1
        ctypes.c_uint32.from_address(metadata + 32).value = 0
    return None


def _error(frame: int, message: str):
    """An XLA_FFI_Error carrying ``message`` (XLA raises it where the program was run)."""
    try:
        api = _word(frame + 16)
        text = message.encode(errors="replace")
        args = _ErrorCreateArgs(ctypes.sizeof(_ErrorCreateArgs), None, text, _INTERNAL)
        return _function(api, _ERROR_CREATE)(ctypes.addressof(args))
    except BaseException:   # noqa: BLE001 - nothing better to hand XLA than no error at all
        return None
