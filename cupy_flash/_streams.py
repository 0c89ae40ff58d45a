"""The ``stream=`` argument of every public function.

Kernels run on CuPy's current stream. ``stream=`` names another for one call: a
``cupy.cuda.Stream``, a PyTorch ``torch.cuda.Stream`` (or any object with a ``cuda_stream`` pointer
or the ``__cuda_stream__`` protocol), or a raw ``cudaStream_t`` as an int. The call's inputs are
taken (DLPack waits on the producer for the consumer's stream), its kernels launched and its
outputs allocated on that stream, so work queued there before the call is ordered before it.
"""

from __future__ import annotations

import functools
import inspect
import numbers
import threading
import weakref


def as_cupy_stream(stream):
    """A CuPy stream for ``stream`` (None: None, the current stream), or TypeError naming it."""
    import cupy

    if stream is None or isinstance(stream, cupy.cuda.Stream | cupy.cuda.ExternalStream):
        return stream
    if hasattr(stream, "__cuda_stream__"):        # the CUDA stream protocol: (version, pointer)
        source = stream
    elif hasattr(stream, "cuda_stream"):          # torch.cuda.Stream, numba streams
        source = _StreamPointer(int(stream.cuda_stream))
    elif isinstance(stream, numbers.Integral) and not isinstance(stream, bool):
        source = _StreamPointer(int(stream))
    else:
        raise TypeError(f"stream must be a cupy.cuda.Stream, a torch.cuda.Stream, an object with "
                        f"__cuda_stream__ or a cudaStream_t int, got {type(stream).__name__}")
    pointer = int(source.__cuda_stream__()[1])
    if pointer == 0:
        return cupy.cuda.Stream.null
    if hasattr(cupy.cuda.Stream, "from_external"):   # CuPy >= 14 (ExternalStream is deprecated)
        return cupy.cuda.Stream.from_external(source)   # holds a reference to the source
    return cupy.cuda.ExternalStream(pointer)


class _StreamPointer:
    """A raw cudaStream_t as the CUDA stream protocol's object."""

    def __init__(self, pointer: int):
        self.pointer = pointer

    def __cuda_stream__(self):
        return (0, self.pointer)


STREAM_DOC = """
    ``stream``: run on this stream instead of CuPy's current one (a cupy.cuda.Stream, a
    torch.cuda.Stream, anything with ``__cuda_stream__``, or a cudaStream_t int); work queued there
    before the call comes first.
    """


# Under CUDA-graph capture, the arrays a call's kernels read and write (its temporaries: split
# partials, dq accumulators, contiguous copies) must outlive the call: CuPy's pool would hand their
# memory to the next allocation, and every replay would write into it (seen on the H100: a replay
# overwrote arrays allocated after the capture). So make_params records each kernel's arrays
# during a public call, and when the call's stream is capturing, the outermost public call ties
# them to its outputs' lifetime.
_capture = threading.local()


def record_kernel_arrays(arrays) -> None:
    """Called by make_params with a kernel's arrays: noted while a public call runs."""
    held = getattr(_capture, "held", None)
    if held is not None:
        held.extend(array for array in arrays if array is not None)


def _release(*held) -> None:
    """weakref.finalize's callback: the arrays in ``held`` are let go with it."""


def _arrays_in(result):
    import cupy

    if isinstance(result, cupy.ndarray):
        yield result
    elif isinstance(result, tuple | list):
        for item in result:
            yield from _arrays_in(item)


def _run_collecting(function, args, kwargs):
    """function(*args, **kwargs); if the current stream is capturing a graph, the arrays its
    kernels use stay alive as long as any of its outputs does."""
    import cupy

    if getattr(_capture, "held", None) is not None:
        return function(*args, **kwargs)   # inside a public call, which collects
    _capture.held = held = []
    try:
        result = function(*args, **kwargs)
    finally:
        _capture.held = None
    # Asked only once kernels ran (a call that fails its checks may run where there is no GPU).
    if not held or not cupy.cuda.get_current_stream().is_capturing():
        return result
    outputs = list(_arrays_in(result))
    returned = {id(x) for x in outputs}
    kept = tuple(x for x in held if id(x) not in returned)   # an output held by itself would never die
    for output in outputs:
        weakref.finalize(output, _release, *kept)
    return result


def on_stream(function):
    """Give ``function`` a ``stream=None`` keyword (and STREAM_DOC at the end of its docstring):
    the body runs with that stream current (and, under graph capture, its temporaries live as
    long as its outputs)."""

    @functools.wraps(function)
    def wrapper(*args, stream=None, **kwargs):
        chosen = as_cupy_stream(stream)
        if chosen is None:
            return _run_collecting(function, args, kwargs)
        with chosen:
            return _run_collecting(function, args, kwargs)

    wrapper.__doc__ = (function.__doc__ or "").rstrip() + "\n" + STREAM_DOC
    wrapper.__signature__ = _with_stream(inspect.signature(function))
    return wrapper


def _with_stream(signature: inspect.Signature) -> inspect.Signature:
    """``signature`` with the keyword-only ``stream=None`` the wrapper takes (before any **kwargs),
    so help() and inspect.signature show what a call accepts."""
    parameters = list(signature.parameters.values())
    at = len(parameters) - (parameters and parameters[-1].kind is inspect.Parameter.VAR_KEYWORD)
    parameters.insert(at, inspect.Parameter("stream", inspect.Parameter.KEYWORD_ONLY, default=None))
    return signature.replace(parameters=parameters)
