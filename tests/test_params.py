"""CPU: the kernels' params record, and a cached launch plan's copy of it with new addresses."""

import numpy
from helpers import FakeGpuArray

from cupy_flash._checks import AttentionShape
from cupy_flash._features import check_variant
from cupy_flash._params import PARAMS_DTYPE, make_params, with_addresses


def _call(base):
    """q, k, v, o, lse of one call at addresses from ``base``."""
    shapes = ((2, 300, 8, 128), (2, 500, 2, 128), (2, 500, 2, 128), (2, 300, 8, 128), (2, 8, 300))
    return tuple(FakeGpuArray(shape, itemsize=4 if i == 4 else 2, ptr=base + (i << 24)) for i, shape in enumerate(shapes))


def test_a_plan_record_with_new_addresses_is_the_record_of_the_new_call():
    shape = AttentionShape(2, 300, 500, 8, 128, "bfloat16", 2)
    variant = check_variant(2, 8, True)
    first, second = _call(1 << 32), _call(7 << 36)
    planned = make_params(shape, 0.125, variant=variant, **dict(zip(("q", "k", "v", "o", "lse"), first)))
    expected = make_params(shape, 0.125, variant=variant, **dict(zip(("q", "k", "v", "o", "lse"), second)))
    argument = with_addresses(planned.tobytes(), *second)   # a plan holds the record's bytes
    assert bytes(argument) == expected.tobytes() and len(bytes(argument)) == PARAMS_DTYPE.itemsize
    assert int(numpy.frombuffer(bytes(argument), numpy.uint64)[3]) == second[3].data.ptr
