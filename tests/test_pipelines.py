"""Fitting into pipelines: stream=, CUDA graphs of forward + backward, flash_vjp, the PyTorch adapter."""

import numpy
import pytest
from helpers import HAS_GPU, bitwise, check_error_rule, random_array, requires_gpu

import cupy_flash
from cupy_flash import attention_reference


@pytest.mark.parametrize("stream, message", [("s", "stream must be"), (1.5, "stream must be"), (True, "stream must be")])
def test_bad_stream_named(stream, message):
    """A bad stream is a TypeError naming it, before any input is looked at."""
    q = numpy.zeros((1, 4, 1, 8), numpy.float16)
    for call in (lambda: cupy_flash.flash_forward(q, q, q, stream=stream),
                 lambda: cupy_flash.flash_backward(q, q, q, q, q, numpy.zeros((1, 1, 4), numpy.float32), stream=stream),
                 lambda: cupy_flash.flash_vjp(q, q, q, stream=stream),
                 lambda: cupy_flash.merge_attention_states([q], [numpy.zeros((1, 1, 4), numpy.float32)], stream=stream)):
        with pytest.raises(TypeError, match=message):
            call()


def test_flash_vjp_checks_before_launch():
    q = numpy.zeros((1, 4, 1, 8), numpy.float16)
    with pytest.raises(TypeError, match="q is a NumPy array"):
        cupy_flash.flash_vjp(q, q, q, causal=True)
    if HAS_GPU:
        import cupy

        g = cupy.zeros((1, 4, 1, 8), cupy.float16)
        with pytest.raises(TypeError, match="unsupported keyword argument.*casual"):
            cupy_flash.flash_vjp(g, g, g, casual=True)


def _inputs(seed, dtype="bfloat16", shape=(2, 300, 4, 64), heads_kv=2):
    rng = numpy.random.default_rng(seed)
    q = random_array(rng, shape, dtype)
    k = random_array(rng, (shape[0], shape[1], heads_kv, shape[3]), dtype)
    v = random_array(rng, (shape[0], shape[1], heads_kv, shape[3]), dtype)
    do = random_array(rng, shape, dtype)
    return q, k, v, do


@requires_gpu
def test_flash_vjp_equals_forward_and_backward():
    import cupy

    q, k, v, do = _inputs(1)
    sink = cupy.asarray([0.5, -1.0, 0.0, 2.0], dtype=cupy.float32)
    o, pullback = cupy_flash.flash_vjp(q, k, v, causal=True, sink=sink)
    o_ref, lse = cupy_flash.flash_forward(q, k, v, causal=True, sink=sink)
    assert bool((bitwise(o) == bitwise(o_ref)).all())
    grads = pullback(do, deterministic=True)
    expected = cupy_flash.flash_backward(do, q, k, v, o_ref, lse, causal=True, sink=sink, deterministic=True)
    assert len(grads) == 4
    for ours, theirs in zip(grads, expected):
        assert bool((bitwise(ours) == bitwise(theirs)).all())


@requires_gpu
def test_cupy_stream_orders_the_call():
    """Inputs written on a non-blocking stream behind a slow kernel: the call on that stream sees
    the new values (on another stream it could read the old ones)."""
    import cupy

    q, k, v, _ = _inputs(2)
    fresh = random_array(numpy.random.default_rng(3), q.shape, "bfloat16")
    stream = cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.Device().synchronize()
    with stream:
        busy = cupy.ones((1 << 26,), cupy.float32)
        for _ in range(20):
            busy = busy * 1.0001   # keep the stream busy before q changes
        q.view(cupy.uint16)[...] = fresh.view(cupy.uint16)
    o, _ = cupy_flash.flash_forward(q, k, v, stream=stream)
    stream.synchronize()
    check_error_rule("o", o, attention_reference(fresh, k, v)[0], attention_reference(fresh, k, v, upcast=False)[0], "stream")


@requires_gpu
def test_torch_stream_orders_the_call():
    """The same on a PyTorch stream, inputs as torch tensors (DLPack, no copy): ordering is kept."""
    torch = pytest.importorskip("torch")
    import cupy

    q, k, v, do = _inputs(4, "float16")
    tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
    fresh = torch.randn(tq.shape, device=tq.device, dtype=torch.float16)
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)   # ~10 ms of GPU time queued before q changes
        tq.copy_(fresh)
    o, lse = cupy_flash.flash_forward(tq, tk, tv, stream=side)
    grads = cupy_flash.flash_backward(do, tq, tk, tv, o, lse, stream=side)
    side.synchronize()
    q_new = cupy.from_dlpack(fresh.detach())
    check_error_rule("o", o, attention_reference(q_new, k, v)[0], attention_reference(q_new, k, v, upcast=False)[0], "torch stream")
    from cupy_flash._checks import as_gpu_array

    assert as_gpu_array("q", tq).data.ptr == tq.data_ptr()   # a torch tensor is taken without a copy
    assert all(bool(cupy.isfinite(g).all()) for g in grads)


@requires_gpu
def test_forward_backward_graph_replay_matches_eager():
    """flash_forward and flash_backward captured in one CUDA graph and replayed on new inputs
    written into the captured buffers give bitwise what eager calls give."""
    import cupy

    q, k, v, do = _inputs(5)
    rng = numpy.random.default_rng(6)
    stream = cupy.cuda.Stream()
    with stream:
        def step():
            o, lse = cupy_flash.flash_forward(q, k, v, causal=True)
            return (o, lse) + tuple(cupy_flash.flash_backward(do, q, k, v, o, lse, causal=True, deterministic=True))

        step()   # compile and warm the pool before capture
        stream.synchronize()
        stream.begin_capture()
        captured = step()
        graph = stream.end_capture()
        for trial in range(2):
            for x in (q, k, v, do):
                x.view(cupy.uint16)[...] = random_array(rng, x.shape, "bfloat16").view(cupy.uint16)
            graph.launch()
            eager = step()
            stream.synchronize()
            for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), captured, eager):
                assert bool((bitwise(a) == bitwise(b)).all()), f"trial {trial}: {name}"


@requires_gpu
def test_graph_replay_leaves_later_allocations_alone():
    """Temporaries of captured calls (split partials, dq accumulators, GQA's per-head dk/dv) live as
    long as the calls' outputs: arrays allocated after the capture, of every size the
    capture allocated, keep their contents through replays, and the replays still match eager."""
    import cupy

    q, k, v, do = _inputs(8)
    pool = cupy.get_default_memory_pool()
    sizes = []

    def recording_malloc(size):
        sizes.append(size)
        return pool.malloc(size)

    def step():
        o, lse = cupy_flash.flash_forward(q[:, :1], k, v, num_splits=4)             # split path
        cache = dict(cache_seqlens=cupy.full((q.shape[0],), k.shape[1], cupy.int32))
        o_decode, lse_decode = cupy_flash.flash_decode(q[:, :1], k, v, num_splits=3, **cache)
        o_full, lse_full = cupy_flash.flash_forward(q, k, v, causal=True)
        grads = [cupy_flash.flash_backward(do, q, k, v, o_full, lse_full, causal=True, deterministic=d)
                 for d in (False, True)]
        return (o, lse, o_decode, lse_decode, o_full, lse_full) + tuple(g for pair in grads for g in pair)

    stream = cupy.cuda.Stream()
    with stream:
        step()   # compile and warm the pool
        stream.synchronize()
        with cupy.cuda.using_allocator(recording_malloc):
            stream.begin_capture()
            captured = step()
            graph = stream.end_capture()
        victims = [cupy.full(size, 0x5A, dtype=cupy.uint8) for size in sizes for _ in range(2)]
        stream.synchronize()
        for _ in range(2):
            graph.launch()
        eager = step()
        stream.synchronize()
    assert sizes, "the capture allocated nothing: the test checks nothing"
    overwritten = [x.size for x in victims if not bool((x == 0x5A).all())]
    assert not overwritten, f"replays wrote into arrays of {overwritten} bytes allocated after the capture"
    for i, (a, b) in enumerate(zip(captured, eager)):
        assert bool((bitwise(a) == bitwise(b)).all()), f"output {i}"


@requires_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_torch_adapter_matches_sdpa(dtype):
    """flash_attn_func's values and gradients against PyTorch SDPA (math, float64 as the truth):
    our error at most twice SDPA's own in the dtype (causal, GQA 4:1, a ragged length)."""
    torch = pytest.importorskip("torch")
    from cupy_flash.torch_adapter import flash_attn_func

    torch_dtype = getattr(torch, dtype)
    gen = torch.Generator(device="cuda").manual_seed(7)
    b, n, h, h_kv, d = 2, 257, 8, 2, 64
    q = torch.randn(b, n, h, d, device="cuda", dtype=torch_dtype, generator=gen).requires_grad_()
    k = torch.randn(b, n, h_kv, d, device="cuda", dtype=torch_dtype, generator=gen).requires_grad_()
    v = torch.randn(b, n, h_kv, d, device="cuda", dtype=torch_dtype, generator=gen).requires_grad_()
    do = torch.randn(b, n, h, d, device="cuda", dtype=torch_dtype, generator=gen)

    def sdpa(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True).transpose(1, 2)

    results = {}
    for name, fn, cast in (("ours", flash_attn_func, None), ("sdpa", sdpa, None), ("exact", sdpa, torch.float64)):
        leaves = [x.detach().to(cast or x.dtype).requires_grad_() for x in (q, k, v)]
        o = fn(*leaves, causal=True) if name == "ours" else fn(*leaves)
        o.backward(do.to(cast or do.dtype))
        results[name] = [o.detach()] + [x.grad for x in leaves]
    for i, label in enumerate(("o", "dq", "dk", "dv")):
        exact = results["exact"][i]
        ours_err = (results["ours"][i].double() - exact).abs().max().item()
        sdpa_err = (results["sdpa"][i].double() - exact).abs().max().item()
        assert results["ours"][i].dtype == torch_dtype and results["ours"][i].shape == exact.shape
        assert ours_err <= 2 * sdpa_err + 1e-5 * max(1.0, exact.abs().max().item()), (label, ours_err, sdpa_err)


@requires_gpu
def test_forward_into_and_backward_into_write_the_given_buffers_and_check_them():
    """The adapters' entry points: results land in the caller's buffers (the same memory, bitwise
    flash_forward's / flash_backward's), and a buffer of the wrong shape, dtype or layout is a
    ValueError naming it, raised before any launch."""
    import cupy

    from cupy_flash.backward import backward_into
    from cupy_flash.forward import forward_into

    rng = numpy.random.default_rng(11)
    q, do = (random_array(rng, (2, 100, 4, 64), "bfloat16") for _ in range(2))
    k, v = (random_array(rng, (2, 130, 2, 64), "bfloat16") for _ in range(2))
    o, lse = cupy.empty_like(q), cupy.empty((2, 4, 100), cupy.float32)
    got = forward_into((o, lse), q, k, v, causal=True)
    expected = cupy_flash.flash_forward(q, k, v, causal=True)
    assert got[0].data.ptr == o.data.ptr and got[1].data.ptr == lse.data.ptr
    assert all(bool((bitwise(a) == bitwise(b)).all()) for a, b in zip((o, lse), expected))
    grads = tuple(cupy.empty_like(x) for x in (q, k, v))
    returned = backward_into(grads, do, q, k, v, o, lse, causal=True, deterministic=True)
    expected = cupy_flash.flash_backward(do, q, k, v, o, lse, causal=True, deterministic=True)
    assert all(a.data.ptr == b.data.ptr for a, b in zip(returned, grads))
    assert all(bool((bitwise(a) == bitwise(b)).all()) for a, b in zip(grads, expected))
    strided = cupy.empty((2, 4, 100, 64), q.dtype).transpose(0, 2, 1, 3)   # q's shape, not C-contiguous
    for bad, name in (((o[:, :50], lse), "o"), ((o, lse.astype(cupy.float16)), "lse"), ((strided, lse), "o")):
        with pytest.raises(ValueError, match=f"^{name} \\(an output buffer\\)"):
            forward_into(bad, q, k, v, causal=True)
    with pytest.raises(ValueError, match=r"^dk \(an output buffer\)"):
        backward_into((grads[0], grads[0], grads[2]), do, q, k, v, o, lse, causal=True)
    # 2 bytes off 16-byte alignment: the kernels' vector stores (and the Hopper dQ kernel's tensor
    # map) would fault, a sticky CUDA error.
    misaligned = cupy.empty(q.size + 1, q.dtype)[1:].reshape(q.shape)
    with pytest.raises(ValueError, match=r"^dq \(an output buffer\).*address % 16 = 2"):
        backward_into((misaligned, grads[1], grads[2]), do, q, k, v, o, lse, causal=True)
    with pytest.raises(ValueError, match=r"^o \(an output buffer\).*address % 16 = 2"):
        forward_into((misaligned, lse), q, k, v, causal=True)
