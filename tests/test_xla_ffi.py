"""The JAX adapter's custom call (cupy_flash._xla_ffi) on JAX's CPU platform: XLA's call frame read
right (addresses, shapes, dtypes, the callback's attribute), under jit and vmap, and a Python error
raised where the program runs. Skipped where jax is absent; the GPU side is test_adapters_gpu.py."""

import ctypes

import numpy
import pytest


def _cpu_jax():
    jax = pytest.importorskip("jax")
    pytest.importorskip("jax.ffi")
    return jax


def _copying(seen):
    """A callback copying its one input into each output (host memory on the CPU platform)."""
    def copy(call):
        (x,), outputs = call.inputs_described(), call.outputs_described()
        seen.append((x.shape, x.dtype, call.shape(0), call.inputs, call.outputs, call.stream))
        assert call.inputs == (x.pointer,) and call.outputs == tuple(y.pointer for y in outputs)
        nbytes = int(numpy.prod(x.shape)) * x.dtype.itemsize
        for y in outputs:
            assert y.shape == x.shape and y.dtype == x.dtype
            ctypes.memmove(y.pointer, x.pointer, nbytes)
    return copy


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "int32", "uint8"])
def test_custom_call_reads_the_frame(dtype):
    jax = _cpu_jax()
    import jax.numpy as jnp

    from cupy_flash import _xla_ffi

    seen = []
    x = (jnp.arange(2 * 3 * 5) % 251).astype(dtype).reshape(2, 3, 5)
    results = (jax.ShapeDtypeStruct(x.shape, x.dtype),) * 2
    copy = jax.jit(_xla_ffi.python_call(_copying(seen), results, vmap_method="broadcast_all", platform="cpu"))
    with jax.default_device(jax.devices("cpu")[0]):
        y, z = copy(x)
        assert (numpy.asarray(y) == numpy.asarray(x)).all() and (numpy.asarray(z) == numpy.asarray(x)).all()
        shape, seen_dtype, first_shape, inputs, outputs, stream = seen[-1]
        assert shape == (2, 3, 5) and first_shape == shape and seen_dtype == numpy.dtype(dtype)
        assert len(inputs) == 1 and len(outputs) == 2 and len(set(inputs + outputs)) == 3 and stream == 0
        # vmap of the traced call: the same callback with a batch axis in front, seen in the shape.
        stacked = jnp.stack([x, x + 1])
        y, _ = jax.vmap(copy)(stacked)
        assert seen[-1][0] == (2, 2, 3, 5) and (numpy.asarray(y) == numpy.asarray(stacked)).all()


def test_custom_call_raises_the_callbacks_error():
    jax = _cpu_jax()
    import jax.numpy as jnp

    from cupy_flash import _xla_ffi

    def failing(call):
        raise ValueError("q has a shape this call cannot take")

    x = jnp.ones((4,), jnp.float32)
    call = jax.jit(_xla_ffi.python_call(failing, jax.ShapeDtypeStruct(x.shape, x.dtype), platform="cpu"))
    with jax.default_device(jax.devices("cpu")[0]), pytest.raises(Exception, match="q has a shape this call cannot take"):
        call(x).block_until_ready()


def test_custom_calls_keep_their_own_callbacks():
    jax = _cpu_jax()
    import jax.numpy as jnp

    from cupy_flash import _xla_ffi

    def filling(value):
        def fill(call):
            (y,) = call.outputs_described()
            ctypes.memmove(y.pointer, numpy.full(y.shape, value, numpy.float32).ctypes.data, 4 * int(numpy.prod(y.shape)))
        return fill

    x = jnp.zeros((3,), jnp.float32)
    first, second = (_xla_ffi.python_call(filling(v), jax.ShapeDtypeStruct(x.shape, x.dtype), platform="cpu") for v in (1.0, 2.0))
    with jax.default_device(jax.devices("cpu")[0]):
        total = jax.jit(lambda x: first(x) + 10 * second(x))(x)
        assert (numpy.asarray(total) == 21.0).all()


def test_a_gpu_custom_call_placed_on_the_cpu_is_refused_before_it_runs():
    """The kernels' target exists on CUDA alone: a call XLA places on the host fails when it is
    compiled, and the callback never runs on host memory."""
    jax = _cpu_jax()
    import jax.numpy as jnp

    from cupy_flash import _xla_ffi

    ran = []
    x = jnp.ones((4,), jnp.float32)
    call = jax.jit(_xla_ffi.python_call(lambda call: ran.append(call), jax.ShapeDtypeStruct(x.shape, x.dtype)))
    with jax.default_device(jax.devices("cpu")[0]), pytest.raises(Exception, match="cupy_flash_call"):
        call(jax.device_put(x, jax.devices("cpu")[0])).block_until_ready()
    assert not ran
