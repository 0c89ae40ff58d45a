"""GPU: the short host paths and their caches. A repeated call finds its checked plan by a key of
what the checks read (flash_forward, flash_backward, flash_decode on CuPy arrays; the PyTorch
adapter by the tensors; the JAX adapter's callbacks by XLA's stream) and launches on the new
addresses. Each cache must give what the checked route gives, bit for bit, on new addresses,
another stream, another device, under graph capture, and must not be found by what its key does
not hold (a misaligned view, another dtype of an option)."""

import numpy
import pytest
from helpers import bitwise, jax_on_gpu, poisoned_allocations, random_array, requires_gpu, torch_on_gpu

import cupy_flash

pytestmark = requires_gpu


def _same(a, b, label):
    assert bool((bitwise(a) == bitwise(b)).all()), label


def _device_count() -> int:
    import cupy

    return cupy.cuda.runtime.getDeviceCount()


def _decode_inputs(rng, lengths=(700, 1500)):
    import cupy

    batch, capacity, heads, heads_kv, d = len(lengths), 2048, 16, 2, 128
    q = random_array(rng, (batch, 1, heads, d), "bfloat16")
    k_cache, v_cache = (random_array(rng, (batch, capacity, heads_kv, d), "bfloat16") for _ in range(2))
    k_new, v_new = (random_array(rng, (batch, 1, heads_kv, d), "bfloat16") for _ in range(2))
    return q, k_cache, v_cache, cupy.asarray(lengths, dtype=cupy.int32), k_new, v_new


def test_decode_plans_hold_for_new_arrays_lengths_streams_and_graphs():
    """flash_decode's plan cache: calls on new arrays, new lengths (read on the device), another
    stream and a captured graph equal the checked route's (the cache emptied) bit for bit; a
    misaligned k_new, a list window and ALiBi take the checked route."""
    import cupy

    from cupy_flash import decode

    rng = numpy.random.default_rng(3)

    def both(q, k_cache, v_cache, lengths, k_new, v_new, **options):
        """(cached route, checked route) of the same call on copies of the caches (it appends)."""
        results = []
        for clear in (False, True):
            if clear:
                decode._plans.clear()
            with poisoned_allocations():
                results.append(cupy_flash.flash_decode(q, k_cache.copy(), v_cache.copy(), cache_seqlens=lengths,
                                                       k_new=k_new, v_new=v_new, **options))
        return results

    decode._plans.clear()
    inputs = _decode_inputs(rng)
    cupy_flash.flash_decode(inputs[0], inputs[1].copy(), inputs[2].copy(), cache_seqlens=inputs[3], k_new=inputs[4],
                            v_new=inputs[5], causal=True)
    assert len(decode._plans) == 1
    for step in range(3):   # new arrays and lengths, the same shapes: the kept plan
        inputs = _decode_inputs(rng, lengths=(100 + 300 * step, 2000 - 500 * step))
        cached, checked = both(*inputs, causal=True)
        for name, a, b in zip(("o", "lse"), cached, checked):
            _same(a, b, f"{name} step {step}")
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        cached, checked = both(*inputs, causal=True)
        stream.synchronize()
    _same(cached[0], checked[0], "another stream")
    # A misaligned k_new (copied by the checked route) and a window given as a list: not the plan.
    flat = random_array(rng, (inputs[4].size + 1,), "bfloat16")
    k_off = flat[1:].reshape(inputs[4].shape)
    k_off[...] = inputs[4]
    expected = cupy_flash.flash_decode(inputs[0], inputs[1].copy(), inputs[2].copy(), cache_seqlens=inputs[3],
                                       k_new=inputs[4], v_new=inputs[5], causal=True)
    got = cupy_flash.flash_decode(inputs[0], inputs[1].copy(), inputs[2].copy(), cache_seqlens=inputs[3], k_new=k_off,
                                  v_new=inputs[5], causal=True)
    _same(got[0], expected[0], "misaligned k_new")
    windowed = [cupy_flash.flash_decode(inputs[0], inputs[1].copy(), inputs[2].copy(), cache_seqlens=inputs[3],
                                        k_new=inputs[4], v_new=inputs[5], window_size=window)[0]
                for window in ((256, 0), [256, 0], (256, 0))]
    _same(windowed[1], windowed[0], "a list window")
    _same(windowed[2], windowed[0], "a tuple window after a list")
    with pytest.raises(TypeError, match="causal"):
        cupy_flash.flash_decode(inputs[0], inputs[1], inputs[2], cache_seqlens=inputs[3], causal=1)
    slopes = cupy.full((16,), 0.01, dtype=cupy.float32)
    kept = len(decode._plans)
    cupy_flash.flash_decode(inputs[0], inputs[1].copy(), inputs[2].copy(), cache_seqlens=inputs[3], alibi_slopes=slopes)
    assert len(decode._plans) == kept, "a call with ALiBi kept a plan"
    # Captured: the graph replays what a direct call gives.
    captured = cupy.cuda.Stream(non_blocking=True)
    q, k_cache, v_cache, lengths, k_new, v_new = inputs
    with captured:
        caches = k_cache.copy(), v_cache.copy()
        cupy_flash.flash_decode(q, *caches, cache_seqlens=lengths, k_new=k_new, v_new=v_new, causal=True)
        caches = k_cache.copy(), v_cache.copy()
        captured.begin_capture()
        o_graph, _ = cupy_flash.flash_decode(q, *caches, cache_seqlens=lengths, k_new=k_new, v_new=v_new, causal=True)
        graph = captured.end_capture()
        graph.launch()
        captured.synchronize()
    direct = cupy_flash.flash_decode(q, k_cache.copy(), v_cache.copy(), cache_seqlens=lengths, k_new=k_new, v_new=v_new,
                                     causal=True)
    _same(o_graph, direct[0], "graph replay")


def test_fp8_decode_keeps_its_plan_and_reads_each_calls_descales():
    """An FP8 cache's call with (batch, heads_kv) descales keeps its plan; a repeat on new caches and
    new descale values equals the checked route bit for bit (the plan reads each call's descales);
    (heads_kv,) descales, which the checked route broadcasts into a copy, keep none."""

    from cupy_flash import decode

    rng = numpy.random.default_rng(11)

    def fp8_inputs():
        q, k_cache, v_cache, lengths, k_new, v_new = _decode_inputs(rng)
        (k8, k_descale), (v8, v_descale) = (cupy_flash.quantize_fp8(x) for x in (k_cache, v_cache))
        return q, k8, v8, lengths, k_new, v_new, k_descale, v_descale

    def call(q, k8, v8, lengths, k_new, v_new, k_descale, v_descale):
        with poisoned_allocations():
            return cupy_flash.flash_decode(q, k8.copy(), v8.copy(), cache_seqlens=lengths, k_new=k_new, v_new=v_new,
                                           k_descale=k_descale, v_descale=v_descale, causal=True)

    decode._plans.clear()
    call(*fp8_inputs())
    assert len(decode._plans) == 1, "an FP8 call with (batch, heads_kv) descales kept no plan"
    for step in range(2):
        inputs = fp8_inputs()
        scaled = inputs[:6] + (inputs[6] * (2.0 + step), inputs[7] * 0.5)   # new values at new addresses
        cached = call(*scaled)
        decode._plans.clear()
        checked = call(*scaled)
        for name, a, b in zip(("o", "lse"), cached, checked):
            _same(a, b, f"FP8 {name} step {step}")
    decode._plans.clear()
    inputs = fp8_inputs()
    call(*inputs[:6], inputs[6][0].copy(), inputs[7][0].copy())
    assert not decode._plans, "(heads_kv,) descales, copied by the checked route, kept a plan"


def test_plans_are_per_device():
    """Arrays on another GPU than the current one, and the same shapes on each GPU: each call runs
    on its arrays' device (a plan's kernel belongs to one device), equal to that device's own calls."""
    import cupy

    if _device_count() < 2:
        pytest.skip("needs two GPUs")
    rng = numpy.random.default_rng(5)
    shape = (2, 300, 4, 64)
    host = [numpy.asarray(random_array(rng, shape, "bfloat16", xp=numpy)) for _ in range(4)]
    results = {}
    for device in (0, 1):
        with cupy.cuda.Device(device):
            q, k, v, do = (cupy.asarray(x) for x in host)
            o, lse = cupy_flash.flash_forward(q, k, v, causal=True)
            o, lse = cupy_flash.flash_forward(q, k, v, causal=True)   # the kept plan
            grads = cupy_flash.flash_backward(do, q, k, v, o, lse, causal=True, deterministic=True)
            grads = cupy_flash.flash_backward(do, q, k, v, o, lse, causal=True, deterministic=True)
            results[device] = [cupy.asnumpy(x.view(cupy.uint16)) for x in (o, *grads)]
            arrays = (q, k, v, do)
    with cupy.cuda.Device(0):   # device 1's arrays while device 0 is current: the checked route
        q, k, v, do = arrays
        o, lse = cupy_flash.flash_forward(q, k, v, causal=True)
        assert o.device.id == 1
        grads = cupy_flash.flash_backward(do, q, k, v, o, lse, causal=True, deterministic=True)
        other = [cupy.asnumpy(x.view(cupy.uint16)) for x in (o, *grads)]
    for name, a, b, c in zip(("o", "dq", "dk", "dv"), results[0], results[1], other):
        assert (a == b).all(), f"{name}: device 1 against device 0"
        assert (a == c).all(), f"{name}: device 1's arrays from device 0"


def test_torch_adapter_plans_hold_for_new_tensors_streams_and_views():
    """The PyTorch adapter's plan caches: eager calls (no grad, and with an autograd node and its
    backward) on new tensors, on a side stream and on misaligned views equal cupy_flash's calls on
    the same data bit for bit (deterministic gradients)."""
    torch = torch_on_gpu()
    import cupy

    from cupy_flash import torch_adapter
    from cupy_flash.torch_adapter import flash_attn_func

    gen = torch.Generator(device="cuda").manual_seed(7)

    def tensors():
        return [torch.randn(2, 333, 4, 64, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4)]

    def direct(q, k, v, do):
        views = [cupy.from_dlpack(x.detach().view(torch.int16)).view(cupy.uint16) for x in (q, k, v, do)]
        import ml_dtypes

        q_, k_, v_, do_ = (x.view(ml_dtypes.bfloat16) for x in views)
        o, lse = cupy_flash.flash_forward(q_, k_, v_, causal=True)
        return (o,) + tuple(cupy_flash.flash_backward(do_, q_, k_, v_, o, lse, causal=True, deterministic=True))

    def ours(q, k, v, do):
        with torch.no_grad():
            no_grad = flash_attn_func(q, k, v, causal=True)
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        # an atomic backward first: the deterministic call after it takes a plan of its own
        flash_attn_func(q, k, v, causal=True).backward(do)
        q.grad = k.grad = v.grad = None
        o = flash_attn_func(q, k, v, causal=True, deterministic=True)
        o.backward(do)
        assert torch.equal(no_grad, o.detach())
        return [cupy.from_dlpack(x.detach().view(torch.int16)).view(cupy.uint16) for x in (o, q.grad, k.grad, v.grad)]

    for step in range(3):   # new tensors: from the second call on, the kept plans
        q, k, v, do = tensors()
        for name, a, b in zip(("o", "dq", "dk", "dv"), ours(q, k, v, do), direct(q, k, v, do)):
            _same(a, b.view(cupy.uint16), f"{name} step {step}")
    assert torch_adapter._forward_plans and torch_adapter._backward_plans
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = ours(q, k, v, do)
    side.synchronize()
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, direct(q, k, v, do)):
        _same(a, b.view(cupy.uint16), f"{name} on a side stream")
    flat = torch.empty(q.numel() + 1, device="cuda", dtype=torch.bfloat16)
    q_off = flat[1:].view(q.shape)
    q_off.copy_(q)
    for name, a, b in zip(("o", "dq", "dk", "dv"), ours(q_off, k, v, do), direct(q, k, v, do)):
        _same(a, b.view(cupy.uint16), f"{name} of a misaligned q")
    do_off = flat[1:].view(do.shape)   # a misaligned gradient, after aligned ones kept the backward's plan
    do_off.copy_(do)
    for name, a, b in zip(("o", "dq", "dk", "dv"), ours(q, k, v, do_off), direct(q, k, v, do)):
        _same(a, b.view(cupy.uint16), f"{name} of a misaligned do")
    # An eager step captured in a CUDA graph (the checked route under capture) replays the same bits
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    static_do = do.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        flash_attn_func(q, k, v, causal=True, deterministic=True).backward(static_do)   # warm, outside the capture
    torch.cuda.current_stream().wait_stream(side)
    q.grad = k.grad = v.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = flash_attn_func(q, k, v, causal=True, deterministic=True)
        o.backward(static_do)
    graph.replay()
    torch.cuda.synchronize()
    got = [cupy.from_dlpack(x.detach().view(torch.int16)).view(cupy.uint16) for x in (o, q.grad, k.grad, v.grad)]
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, direct(q, k, v, do)):
        _same(a, b.view(cupy.uint16), f"{name} of an eager step replayed from a CUDA graph")


def test_torch_compiled_training_step_replays_bitwise_in_a_cuda_graph():
    """A training step compiled with torch.compile(fullgraph=True) (the custom ops), run eagerly and
    captured in a CUDA graph, replays what the uncaptured compiled step and the eager step give,
    bit for bit (deterministic dQ)."""
    torch = torch_on_gpu()
    from cupy_flash.torch_adapter import flash_attn_func

    gen = torch.Generator(device="cuda").manual_seed(11)
    q, k, v = (torch.randn(2, 500, 4, 64, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for _ in range(3))
    do = torch.randn(2, 500, 4, 64, device="cuda", dtype=torch.bfloat16, generator=gen)

    def attention(q, k, v):
        return flash_attn_func(q, k, v, causal=True, deterministic=True)

    compiled = torch.compile(attention, fullgraph=True)

    def step(fn):
        q.grad = k.grad = v.grad = None
        o = fn(q, k, v)
        o.backward(do)
        return o.detach().clone(), q.grad.clone(), k.grad.clone(), v.grad.clone()

    eager = step(attention)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            reference = step(compiled)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    q.grad = k.grad = v.grad = None
    with torch.cuda.graph(graph):
        captured = step(compiled)
    graph.replay()
    torch.cuda.synchronize()
    for a, b, c, label in zip(captured, reference, eager, ("o", "dq", "dk", "dv")):
        assert torch.equal(a, b), f"{label}: the graph's replay against the compiled step"
        assert torch.equal(b, c), f"{label}: the compiled step against the eager one"


def test_jax_jitted_calls_on_new_inputs_take_the_kept_plan():
    """The JAX adapter's callbacks keep the plan of their first execution: later executions on new
    buffers equal cupy_flash's calls on the same data bit for bit (deterministic gradients)."""
    import os

    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.4")   # leave the rest to CuPy's pool
    jax = jax_on_gpu()
    import cupy
    import jax.numpy as jnp

    from cupy_flash.jax_adapter import flash_attention

    @jax.jit
    def value_and_grads(q, k, v, do):
        o, vjp = jax.vjp(lambda q, k, v: flash_attention(q, k, v, causal=True, deterministic=True), q, k, v)
        return (o,) + vjp(do)

    def as_cupy(x):
        return cupy.from_dlpack(x.view(jnp.uint16))

    for step in range(3):
        keys = jax.random.split(jax.random.PRNGKey(step), 4)
        q, do = (jax.random.normal(key, (2, 333, 4, 64), jnp.bfloat16) for key in (keys[0], keys[3]))
        k, v = (jax.random.normal(key, (2, 400, 2, 64), jnp.bfloat16) for key in keys[1:3])
        results = [as_cupy(x) for x in value_and_grads(q, k, v, do)]
        import ml_dtypes

        cq, ck, cv, cdo = (as_cupy(x).view(ml_dtypes.bfloat16) for x in (q, k, v, do))
        o, lse = cupy_flash.flash_forward(cq, ck, cv, causal=True)
        expected = (o,) + tuple(cupy_flash.flash_backward(cdo, cq, ck, cv, o, lse, causal=True, deterministic=True))
        for name, a, b in zip(("o", "dq", "dk", "dv"), results, expected):
            _same(a, b.view(cupy.uint16), f"{name} call {step}")


@pytest.mark.parametrize("kernels", ["auto", "portable"])
def test_kept_workspaces_hold_for_queued_chains_on_two_streams(monkeypatch, kernels):
    """Short backward and split-decode calls take a workspace kept per (device, host thread, stream)
    (_launch.kept_workspace) rather than a new allocation. Two chains of calls, one per stream,
    issued in turn and queued behind a long matmul, each call reading what the one before wrote
    (the backward's dO is the last dq, the decode's q the last o): equal bit for bit to the same
    chains with every workspace allocated afresh (KEPT_WORKSPACE_BYTES = 0); the two streams' kept
    workspaces differ."""
    import cupy

    from cupy_flash import _launch, families

    rng = numpy.random.default_rng(11)
    q, k, v, do = (random_array(rng, (2, 200, 4, 64), "bfloat16") for _ in range(4))
    query = random_array(rng, (2, 1, 16, 64), "bfloat16")
    caches = [random_array(rng, (2, 3000, 2, 64), "bfloat16") for _ in range(2)]
    lengths = cupy.asarray([2900, 1700], dtype=cupy.int32)
    busy = random_array(rng, (4096, 4096), "float16")
    streams = (cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True))

    def chains():
        with families.use_kernels(kernels):
            o, lse = cupy_flash.flash_forward(q, k, v, causal=True)
            heads = [[do, query] for _ in streams]
            outputs = []
            for stream in streams:
                with stream:
                    busy @ busy
            for _ in range(4):
                for stream, head in zip(streams, heads):
                    with stream:
                        dq, dk, dv = cupy_flash.flash_backward(head[0], q, k, v, o, lse, causal=True, deterministic=True)
                        o_new, lse_new = cupy_flash.flash_decode(head[1], *caches, cache_seqlens=lengths, num_splits=8)
                        head[0], head[1] = (dq * 4).astype(dq.dtype), o_new
                        outputs += [dq, dk, dv, o_new, lse_new]
            cupy.cuda.Device().synchronize()
            return outputs

    _launch._workspaces.clear()
    kept = chains()
    device = cupy.cuda.Device().id
    addresses = {key[2]: w.data.ptr for key, w in _launch._workspaces.items() if key[0] == device}
    assert {s.ptr for s in streams} <= set(addresses) and addresses[streams[0].ptr] != addresses[streams[1].ptr]
    monkeypatch.setattr(_launch, "KEPT_WORKSPACE_BYTES", 0)
    fresh = chains()
    for i, (a, b) in enumerate(zip(kept, fresh)):
        _same(a, b, f"output {i}")


@pytest.mark.parametrize("kernels", ["auto", "portable"])
def test_repeated_launches_replay_as_graphs_bit_for_bit(monkeypatch, kernels):
    """A Packed run a second time (same arrays, stream, thread) is captured into a CUDA graph and
    from then on launched as one (_launch.Packed.run). Forward, deterministic backward (its zeroed
    semaphores ride in the graph) and split decode (early launches) called five times on the same
    buffers, whose contents change between calls: equal bit for bit to the same calls with graphs
    off (CUPY_FLASH_GRAPHS=0, nothing captured); turning early launches off after the capture
    sends the graphs' launches back to the stream one by one, with the same results."""
    import cupy

    from cupy_flash import _launch, backward, decode, families, forward

    rng = numpy.random.default_rng(17)
    q, k, v, do = (random_array(rng, (2, 200, 4, 64), "bfloat16") for _ in range(4))
    query = random_array(rng, (2, 1, 16, 64), "bfloat16")
    caches = [random_array(rng, (2, 3000, 2, 64), "bfloat16") for _ in range(2)]
    lengths = cupy.asarray([2900, 1700], dtype=cupy.int32)
    starts = [x.copy() for x in (q, do, query)]
    captured = []
    capture = _launch._captured

    def noting_capture(packed):
        graph = capture(packed)
        if graph:
            captured.append(packed.names)
        return graph

    monkeypatch.setattr(_launch, "_captured", noting_capture)

    def calls():
        for x, start in zip((q, do, query), starts):
            x[...] = start
        for plans in (forward._plans, backward._plans, decode._plans):
            plans.clear()
        outputs = []
        with families.use_kernels(kernels):
            for step in range(5):
                o, lse = cupy_flash.flash_forward(q, k, v, causal=True)
                grads = cupy_flash.flash_backward(do, q, k, v, o, lse, causal=True, deterministic=True)
                o_new, lse_new = cupy_flash.flash_decode(query, *caches, cache_seqlens=lengths, num_splits=8)
                # to the host, so that the next step's outputs take the same blocks of the pool
                outputs += [cupy.asnumpy(x) for x in (o, lse, *grads, o_new, lse_new)]
                del o, lse, grads, o_new, lse_new
                # new contents, same buffers: the graphs read memory, not values
                q[...] = (q + (step + 1) / 64).astype(q.dtype)
                do[...] = (-do).astype(do.dtype)
                query[...] = (query - 1 / 32).astype(query.dtype)
        cupy.cuda.Device().synchronize()
        return outputs

    monkeypatch.setenv("CUPY_FLASH_GRAPHS", "0")
    direct = calls()
    assert not captured
    monkeypatch.delenv("CUPY_FLASH_GRAPHS")
    graphed = calls()
    assert len(captured) >= 4, captured   # forward, the backward's two, decode
    for i, (a, b) in enumerate(zip(direct, graphed)):
        _same(a, b, f"output {i} (step {i // 7})")
    monkeypatch.setenv("CUPY_FLASH_PDL", "0")
    for i, (a, b) in enumerate(zip(direct, calls())):
        _same(a, b, f"output {i} without early launches")
