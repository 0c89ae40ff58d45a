"""The ``stream=`` argument of every public function.

Kernels run on CuPy's current stream. ``stream=`` names another for one call: a
``cupy.cuda.Stream``, a PyTorch ``torch.cuda.Stream`` (or any object with a ``cuda_stream`` pointer
or the ``__cuda_stream__`` protocol), or a raw ``cudaStream_t`` as an int. The call's inputs are
taken (DLPack waits on the producer for the consumer's stream), its kernels launched and its
outputs allocated on that stream, so work queued there before the call is ordered before it.
"""

from __future__ import annotations

import functools
import numbers


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


def on_stream(function):
    """Give ``function`` a ``stream=None`` keyword (and STREAM_DOC at the end of its docstring):
    the body runs with that stream current."""

    @functools.wraps(function)
    def wrapper(*args, stream=None, **kwargs):
        chosen = as_cupy_stream(stream)
        if chosen is None:
            return function(*args, **kwargs)
        with chosen:
            return function(*args, **kwargs)

    wrapper.__doc__ = (function.__doc__ or "").rstrip() + "\n" + STREAM_DOC
    return wrapper
