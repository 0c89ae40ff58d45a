"""CPU: the kernels' params record, and a cached launch plan's copy of it with new addresses."""

import math

import ml_dtypes
import numpy
import pytest
from helpers import FakeGpuArray

from cupy_flash._checks import AttentionShape
from cupy_flash._features import check_variant
from cupy_flash._params import PARAMS_DTYPE, PointerRecord, make_params


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
    names = ("q", "k", "v", "o", "lse")   # forward.ForwardPlan's record: these five fields per call
    argument = PointerRecord(planned, {name: name for name in names}).filled({n: x.data.ptr for n, x in zip(names, second)})
    assert bytes(argument) == expected.tobytes() and len(bytes(argument)) == PARAMS_DTYPE.itemsize
    assert int(numpy.frombuffer(bytes(argument), numpy.uint64)[3]) == second[3].data.ptr


def test_a_pointer_record_writes_each_bound_field_and_nothing_else():
    """backward.BackwardPlan's records: fields bound to named arrays get those arrays' addresses
    (None: 0); every other byte stays the planned record's."""
    shape = AttentionShape(2, 300, 500, 8, 128, "bfloat16", 2)
    variant = check_variant(2, 8, True)

    def arrays(base):
        q, k, v, o, lse = _call(base)
        return dict(q=q, k=k, v=v, o=o, lse=lse, do=FakeGpuArray(q.shape, ptr=base + (5 << 24)),
                    delta=FakeGpuArray((16, 384), itemsize=4, ptr=base + (6 << 24)),
                    dk_heads=FakeGpuArray((2, 500, 8, 128), ptr=base + (7 << 24)), dq_semaphore=None)

    bindings = dict(q="q", k="k", v="v", o="o", lse="lse", dout="do", delta="delta", dk="dk_heads", dq_semaphore="dq_semaphore")

    def record(named):
        fields = {field: named[name] for field, name in bindings.items()}
        return make_params(shape, 0.125, delta_stride=384, variant=variant, **fields)

    first, second = arrays(1 << 32), arrays(7 << 36)
    planned, expected = record(first), record(second)
    for r in (planned, expected):   # unbound fields between bound ones (a variant's arrays) keep their bytes
        r["sink"], r["lse_log2"], r["bias"] = 0x5151 << 8, 0x1062 << 8, 0xB1A5 << 8
    planned = PointerRecord(planned, bindings)
    addresses = {name: None if x is None else x.data.ptr for name, x in second.items()}
    assert bytes(planned.filled(addresses)) == expected.tobytes()
    assert int(numpy.frombuffer(bytes(planned.filled(addresses)), numpy.uint64)[PARAMS_DTYPE.names.index("dk")]) == \
        second["dk_heads"].data.ptr


def test_kernel_parameters_hold_their_arguments_and_the_cache_starts_again_past_its_limit():
    """_launch.kernel_parameters: cuLaunchKernel's array of the arguments' addresses, holding the
    arguments (a plan keeps it across calls); _launch.cached: made once per key, cleared rather
    than grown past its limit (packed_once's 32 sets a plan)."""
    import ctypes

    from cupy_flash._launch import cached, kernel_parameters

    arguments = (ctypes.create_string_buffer(b"maps", 16), ctypes.c_uint64(7))
    parameters = kernel_parameters(arguments)
    assert [parameters[i] for i in range(2)] == [ctypes.addressof(a) for a in arguments]
    assert parameters.arguments is arguments

    made = []

    def make(key):
        return lambda: made.append(key) or f"value {key}"

    cache: dict = {}
    assert cached(cache, 1, make(1), limit=2) == "value 1"
    assert cached(cache, 1, make(1), limit=2) == "value 1" and made == [1]
    cached(cache, 2, make(2), limit=2)
    assert cached(cache, 3, make(3), limit=2) == "value 3"
    assert cache == {3: "value 3"} and made == [1, 2, 3]


def test_packed_once_keeps_one_pack_per_addresses_stream_and_thread_but_none_under_capture():
    """_launch.packed_once: a plan's parameters are packed once per (addresses, stream, host thread),
    through cached's bound; a capturing stream's launch is packed afresh and not kept."""
    import threading

    from cupy_flash._launch import packed_once

    packs = []

    def pack():
        packs.append(object())
        return packs[-1]

    cache: dict = {}
    first = packed_once(cache, (1, 2), 7, False, pack)
    assert packed_once(cache, (1, 2), 7, False, pack) is first and len(packs) == 1
    assert packed_once(cache, (1, 2), 8, False, pack) is not first and len(packs) == 2
    assert packed_once(cache, (1, 3), 7, False, pack) is not first and len(packs) == 3
    other_thread = []
    thread = threading.Thread(target=lambda: other_thread.append(packed_once(cache, (1, 2), 7, False, pack)))
    thread.start()
    thread.join()
    assert other_thread[0] is not first and len(packs) == 4
    captured = packed_once(cache, (1, 2), 7, True, pack)
    assert captured is not first and len(packs) == 5 and captured not in cache.values()
    for n in range(40):
        packed_once(cache, (n,), 7, False, pack)
    assert len(cache) <= 32


def test_forward_and_decode_plans_allocate_o_like_q_and_a_float32_lse():
    """_launch.OutputAndLse, the forward's and decode's plans' base: o of q's shape, dtype and bytes,
    lse float32 of the plan's shape, both from one allocation: o at its start, lse at the next
    256-byte boundary past o's bytes."""
    from cupy_flash import decode, forward
    from cupy_flash._launch import OutputAndLse

    assert issubclass(forward.ForwardPlan, OutputAndLse) and issubclass(decode.DecodePlan, OutputAndLse)
    q = numpy.zeros((2, 5, 3, 40), numpy.float16)

    allocated = []

    class Cuda:
        @staticmethod
        def alloc(nbytes):   # a stand-in address
            allocated.append(nbytes)
            return 1 << 20

        @staticmethod
        def empty(shape, dtype, memptr):
            return shape, numpy.dtype(dtype), memptr

    plan = OutputAndLse()
    plan.cuda = Cuda()
    plan.plan_outputs(q, (2, 3, 5))
    o, lse = plan.outputs()
    assert o == ((2, 5, 3, 40), numpy.dtype(numpy.float16), 1 << 20)
    assert lse == ((2, 3, 5), numpy.dtype(numpy.float32), (1 << 20) + 2560)   # o: 2400 bytes
    assert allocated == [2560 + 4 * 30]


@pytest.mark.parametrize("dtype", [numpy.float16, ml_dtypes.bfloat16, numpy.float32, numpy.int32])
@pytest.mark.parametrize("shape", [(2, 5, 3, 40), (7,), (3, 0, 2)])
def test_new_arrays_are_what_cupy_ndarray_makes(shape, dtype):
    """_launch.new_array_maker (the outputs' constructor: CuPy's class and its Cython base called
    directly) makes what ``cupy.ndarray(shape, dtype)`` makes, from the same allocator: here one
    that hands out stand-in addresses, so no GPU is needed."""
    import cupy

    from cupy_flash._launch import new_array_maker

    asked = []

    def allocate(nbytes):
        asked.append(nbytes)
        memory = cupy.cuda.UnownedMemory(4096 * len(asked), max(nbytes, 1), None, device_id=0)
        return cupy.cuda.MemoryPointer(memory, 0)

    dtype = numpy.dtype(dtype)
    with cupy.cuda.using_allocator(allocate):
        made = new_array_maker(cupy)(shape, dtype)
        expected = cupy.ndarray(shape, dtype)
    assert asked == [math.prod(shape) * dtype.itemsize] * 2
    assert type(made) is cupy.ndarray and made.base is None and made.data.ptr == 4096
    assert made.flags.owndata and made.flags.c_contiguous and made.flags.f_contiguous == expected.flags.f_contiguous
    assert (made.shape, made.strides, made.dtype, made.size) == (expected.shape, expected.strides, expected.dtype, expected.size)
    # over given memory (the outputs sharing one allocation): what cupy.ndarray(shape, dtype, memptr) makes
    memory = allocate(256 + math.prod(shape) * dtype.itemsize)
    made, expected = new_array_maker(cupy)(shape, dtype, memory + 256), cupy.ndarray(shape, dtype, memory + 256)
    assert type(made) is cupy.ndarray and made.data.ptr == memory.ptr + 256 == expected.data.ptr
    assert made.data.mem is memory.mem and made.flags.c_contiguous and made.flags.owndata == expected.flags.owndata
    assert (made.shape, made.strides, made.dtype, made.size) == (expected.shape, expected.strides, expected.dtype, expected.size)


def test_environment_reader_sees_every_change_of_the_variable(monkeypatch):
    """_launch.environment_reader: os.environ's encoded dict read afresh on each call (set, changed,
    removed; monkeypatch writes through os.environ), and the plain os.environ.get where an
    interpreter keeps no such dict."""
    import os

    from cupy_flash import _launch

    read = _launch.environment_reader("CUPY_FLASH_TEST_VARIABLE")
    monkeypatch.delenv("CUPY_FLASH_TEST_VARIABLE", raising=False)
    assert read() is None
    monkeypatch.setenv("CUPY_FLASH_TEST_VARIABLE", "portable")
    assert read() == "portable"
    os.environ["CUPY_FLASH_TEST_VARIABLE"] = "0"
    assert read() == "0"
    monkeypatch.delenv("CUPY_FLASH_TEST_VARIABLE")
    assert read() is None

    class Interpreter:   # an os module whose environ keeps no encoded dict
        environ = {"CUPY_FLASH_TEST_VARIABLE": "seen"}

    monkeypatch.setattr(_launch, "os", Interpreter)
    fallback = _launch.environment_reader("CUPY_FLASH_TEST_VARIABLE")
    assert fallback() == "seen"
    Interpreter.environ["CUPY_FLASH_TEST_VARIABLE"] = "changed"
    assert fallback() == "changed"
