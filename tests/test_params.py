"""CPU: the kernels' params record, and a cached launch plan's copy of it with new addresses."""

import types

import numpy

from cupy_flash._checks import AttentionShape
from cupy_flash._features import check_variant
from cupy_flash._params import PARAMS_DTYPE, as_argument, make_params, with_addresses


def _array(shape, itemsize, ptr):
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.insert(0, step)
        step *= n
    return types.SimpleNamespace(shape=shape, ndim=len(shape), strides=tuple(strides),
                                 dtype=types.SimpleNamespace(itemsize=itemsize), data=types.SimpleNamespace(ptr=ptr))


def _call(base):
    """q, k, v, o, lse of one call at addresses from ``base``."""
    return (_array((2, 300, 8, 128), 2, base), _array((2, 500, 2, 128), 2, base + (1 << 24)),
            _array((2, 500, 2, 128), 2, base + (2 << 24)), _array((2, 300, 8, 128), 2, base + (3 << 24)),
            _array((2, 8, 300), 4, base + (4 << 24)))


def test_a_plan_record_with_new_addresses_is_the_record_of_the_new_call():
    shape = AttentionShape(2, 300, 500, 8, 128, "bfloat16", 2)
    variant = check_variant(2, 8, True)
    first, second = _call(1 << 32), _call(7 << 36)
    planned = make_params(shape, 0.125, variant=variant, **dict(zip(("q", "k", "v", "o", "lse"), first)))
    expected = make_params(shape, 0.125, variant=variant, **dict(zip(("q", "k", "v", "o", "lse"), second)))
    argument = with_addresses(planned, *second)
    assert argument.tobytes() == as_argument(expected).tobytes()
    assert argument.dtype.itemsize == PARAMS_DTYPE.itemsize and argument.dtype.names is None   # opaque bytes
    assert planned.tobytes() == make_params(shape, 0.125, variant=variant,
                                            **dict(zip(("q", "k", "v", "o", "lse"), first))).tobytes()   # untouched
    assert int(numpy.frombuffer(argument.tobytes(), numpy.uint64)[3]) == second[3].data.ptr
