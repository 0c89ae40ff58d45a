"""GPU: the JAX adapter under jax.jit / jax.grad / jax.vmap, and the PyTorch custom ops under
torch.compile(fullgraph=True) and CUDA-graph capture. Skipped where jax or torch is absent."""

import os

import numpy
import pytest
from helpers import bitwise, check_error_rule, jax_on_gpu, requires_gpu, torch_on_gpu

import cupy_flash
from cupy_flash import attention_reference, attention_reference_backward

pytestmark = requires_gpu
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.4")   # leave the rest to CuPy's pool




def _as_cupy(x):
    import cupy

    return cupy.from_dlpack(x) if "bfloat16" not in str(x.dtype) else cupy.from_dlpack(x.view("uint16")).view(x.dtype)


def _jax_inputs(jax, shape_q, shape_kv, dtype, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(keys[0], shape_q, dtype)
    k, v = (jax.random.normal(key, shape_kv, dtype) for key in keys[1:3])
    do = jax.random.normal(keys[3], shape_q, dtype)
    return q, k, v, do


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
def test_jax_jit_values_and_grads_hold_the_error_rule(dtype, causal):
    jax = jax_on_gpu()
    import jax.numpy as jnp

    from cupy_flash.jax_adapter import flash_attention

    q, k, v, do = _jax_inputs(jax, (2, 333, 4, 64), (2, 400, 2, 64), getattr(jnp, dtype))
    options = dict(causal=causal, window_size=(100, -1) if causal else None)

    @jax.jit
    def value_and_grads(q, k, v, do):
        o, vjp = jax.vjp(lambda q, k, v: flash_attention(q, k, v, **options), q, k, v)
        return (o,) + vjp(do)

    results = [_as_cupy(x) for x in value_and_grads(q, k, v, do)]
    cq, ck, cv, cdo = (_as_cupy(x) for x in (q, k, v, do))
    features = {n: x for n, x in options.items() if x is not None}
    exact = (attention_reference(cq, ck, cv, **features)[0],) + attention_reference_backward(cdo, cq, ck, cv, **features)
    low = ((attention_reference(cq, ck, cv, upcast=False, **features)[0],)
           + attention_reference_backward(cdo, cq, ck, cv, upcast=False, **features))
    for name, ours, e, lo in zip(("o", "dq", "dk", "dv"), results, exact, low):
        check_error_rule(name, ours, e, lo, f"jax jit {dtype} causal={causal}")
    # Against JAX's own attention in float32 (GQA by repeating K/V heads): the same rule.
    def dense(q, k, v):
        k, v = (jnp.repeat(x, 2, axis=2) for x in (k, v))
        mask = None
        if causal:
            rows, cols = jnp.arange(333)[:, None] + (400 - 333), jnp.arange(400)[None, :]
            mask = ((cols <= rows) & (cols >= rows - 100))[None, None]
        return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")
    o32 = dense(*(x.astype(jnp.float32) for x in (q, k, v)))
    check_error_rule("o vs jax.nn.dot_product_attention", results[0], _as_cupy(o32).astype("float64"), low[0],
                     f"jax {dtype} causal={causal}")


def test_jax_vmap_folds_into_the_batch():
    jax = jax_on_gpu()
    import jax.numpy as jnp

    from cupy_flash.jax_adapter import flash_attention

    q, k, v, do = _jax_inputs(jax, (3, 2, 130, 2, 64), (3, 2, 77, 2, 64), jnp.bfloat16)
    mapped = jax.jit(jax.vmap(lambda q, k, v: flash_attention(q, k, v, causal=True)))(q, k, v)
    for i in range(3):
        single = flash_attention(q[i], k[i], v[i], causal=True)
        assert bool((bitwise(_as_cupy(mapped[i])) == bitwise(_as_cupy(single))).all()), f"mapped element {i}"
    def loss(q, k, v):   # deterministic: mapped and single gradients compared bitwise
        return flash_attention(q, k, v, deterministic=True).astype(jnp.float32).sum()
    grads = jax.jit(jax.vmap(jax.grad(loss)))(q, k, v)
    single = jax.grad(loss)(q[1], k[1], v[1])
    assert bool((bitwise(_as_cupy(grads[1])) == bitwise(_as_cupy(single))).all())


def test_jax_vmap_of_a_jitted_call_follows_the_shape():
    """jax.vmap of an already jitted function runs the same traced custom calls with a batch axis in
    front: the plans they keep must be told apart by shape."""
    jax = jax_on_gpu()
    import jax.numpy as jnp

    from cupy_flash.jax_adapter import flash_attention

    q, k, v, do = _jax_inputs(jax, (3, 2, 130, 2, 64), (3, 2, 77, 2, 64), jnp.bfloat16)
    single = jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=True))
    expected = [single(q[i], k[i], v[i]) for i in range(3)]   # plans kept for one element's shape
    mapped = jax.jit(jax.vmap(single))(q, k, v)
    for i in range(3):
        assert bool((bitwise(_as_cupy(mapped[i])) == bitwise(_as_cupy(expected[i]))).all()), f"mapped element {i}"

    grad = jax.jit(jax.grad(lambda q, k, v: flash_attention(q, k, v, deterministic=True).astype(jnp.float32).sum(),
                            argnums=(0, 1, 2)))
    expected = [grad(q[i], k[i], v[i]) for i in range(3)]
    mapped = jax.jit(jax.vmap(grad))(q, k, v)
    for i in range(3):
        for name, ours, theirs in zip(("dq", "dk", "dv"), mapped, expected[i]):
            assert bool((bitwise(_as_cupy(ours[i])) == bitwise(_as_cupy(theirs))).all()), f"{name} of element {i}"


@pytest.mark.parametrize("bad", [
    dict(q=(1, 16, 2, 64), k=(1, 16, 2, 72)),          # head_dim differs
    dict(q=(1, 16, 3, 64), k=(1, 16, 2, 64)),          # heads not a multiple
    dict(q=(1, 16, 2, 520), k=(1, 16, 2, 520)),        # head_dim past 512 (60 runs: padded inside)
    dict(q=(1, 16, 2, 64), k=(1, 16, 2, 64), options=dict(window_size=(-2, 0))),
    dict(q=(1, 16, 2, 64), k=(1, 16, 2, 64), options=dict(softcap=-1.0)),
    dict(q=(1, 16, 2, 64), k=(1, 16, 2, 64), options=dict(causal="yes")),
    dict(q=(1, 16, 2, 64), k=(1, 16, 2, 64), options=dict(softmax_scale=float("nan"))),
])
def test_jax_argument_errors_are_the_cupy_apis(bad):
    jax = jax_on_gpu()
    import cupy
    import jax.numpy as jnp

    from cupy_flash.jax_adapter import flash_attention

    q, k = jnp.zeros(bad["q"], jnp.float16), jnp.zeros(bad["k"], jnp.float16)
    options = bad.get("options", {})
    with pytest.raises((TypeError, ValueError)) as expected:
        cupy_flash.flash_forward(cupy.zeros(bad["q"], cupy.float16), cupy.zeros(bad["k"], cupy.float16),
                                 cupy.zeros(bad["k"], cupy.float16), **options)
    with pytest.raises(type(expected.value)) as got:
        jax.jit(lambda q, k: flash_attention(q, k, k, **options))(q, k)
    assert str(got.value) == str(expected.value)


def test_jax_decode_updates_a_donated_cache_in_place():
    jax = jax_on_gpu()
    import jax.numpy as jnp

    from cupy_flash.jax_adapter import flash_decode

    keys = jax.random.split(jax.random.PRNGKey(3), 5)
    q = jax.random.normal(keys[0], (2, 1, 8, 128), jnp.bfloat16)
    k_cache, v_cache = (jax.random.normal(key, (2, 512, 2, 128), jnp.bfloat16) for key in keys[1:3])
    k_new, v_new = (jax.random.normal(key, (2, 1, 2, 128), jnp.bfloat16) for key in keys[3:5])
    lengths = jnp.asarray([100, 300], jnp.int32)
    # The expected values from copies: a DLPack export of the donated caches themselves would hold
    # an external reference to them, and JAX then copies instead of donating.
    ck, cv = (_as_cupy(jnp.copy(x)).copy() for x in (k_cache, v_cache))
    expected = cupy_flash.flash_decode(_as_cupy(q), ck, cv, cache_seqlens=_as_cupy(lengths), k_new=_as_cupy(k_new),
                                       v_new=_as_cupy(v_new))[0]
    pointer = k_cache.unsafe_buffer_pointer()
    step = jax.jit(lambda q, kc, vc, n, kn, vn: flash_decode(q, kc, vc, n, kn, vn), donate_argnums=(1, 2))
    o, k_cache, v_cache = step(q, k_cache, v_cache, lengths, k_new, v_new)
    assert k_cache.unsafe_buffer_pointer() == pointer, "the donated cache was copied"
    assert bool((bitwise(_as_cupy(o)) == bitwise(expected)).all())
    assert bool((bitwise(_as_cupy(k_cache)) == bitwise(ck)).all()) and bool((bitwise(_as_cupy(v_cache)) == bitwise(cv)).all())


def test_jax_mla_decode_reads_v_from_a_donated_latent_cache():
    """MLA decoding from JAX, which has no views: v_cache=None with head_dim_v=512 under jax.jit, the
    paged latent cache (576 columns) donated and appended to in place, bitwise the CuPy call with v a
    view of k (the MLA kernel); also from an FP8 cache whose v_descale defaults to k_descale."""
    jax = jax_on_gpu()
    import jax.numpy as jnp

    from cupy_flash.jax_adapter import flash_decode

    keys = jax.random.split(jax.random.PRNGKey(7), 3)
    pages, page = 12, 64
    q = jax.random.normal(keys[0], (2, 1, 64, 576), jnp.bfloat16)
    k_new = jax.random.normal(keys[2], (2, 1, 1, 576), jnp.bfloat16)
    block_table = jnp.asarray([[3, 1, 7, 0, 9, 2], [11, 8, 4, 6, 5, 10]], jnp.int32)
    lengths = jnp.asarray([300, 37], jnp.int32)
    for fp8 in (False, True):
        k_cache = jax.random.normal(keys[1], (pages, page, 1, 576), jnp.float32)
        k_cache = k_cache.astype(jnp.float8_e4m3fn) if fp8 else k_cache.astype(jnp.bfloat16)
        scales = dict(k_descale=jnp.asarray([[0.5], [2.0]], jnp.float32)) if fp8 else {}
        as_bits = (lambda x: jax.lax.bitcast_convert_type(x, jnp.uint8)) if fp8 else (lambda x: x)
        ck = _as_cupy(jnp.copy(as_bits(k_cache))).copy()
        expected = cupy_flash.flash_decode(
            _as_cupy(q), ck, ck[..., :512], cache_seqlens=_as_cupy(lengths), k_new=_as_cupy(k_new),
            v_new=_as_cupy(k_new)[..., :512], block_table=_as_cupy(block_table),
            **{name: _as_cupy(x) for name, x in dict(scales, v_descale=scales.get("k_descale")).items() if x is not None})[0]
        pointer = k_cache.unsafe_buffer_pointer()
        step = jax.jit(lambda q, kc, n, kn: flash_decode(q, kc, None, n, kn, head_dim_v=512, block_table=block_table,
                                                         **scales), donate_argnums=(1,))
        o, k_cache, v_cache = step(q, k_cache, lengths, k_new)
        assert v_cache is None and o.shape == (2, 1, 64, 512)
        assert k_cache.unsafe_buffer_pointer() == pointer, "the donated cache was copied"
        assert bool((bitwise(_as_cupy(o)) == bitwise(expected)).all())
        assert bool((bitwise(_as_cupy(as_bits(k_cache))) == bitwise(ck)).all())


def test_jax_decode_takes_the_kvcache_options():
    """The JAX flash_decode with a paged FP8 cache (jnp.float8_e4m3fn), padding before each
    sequence's keys and rotary embedding of q and k_new, under jax.jit: bitwise the CuPy call."""
    jax = jax_on_gpu()
    import jax.numpy as jnp

    from cupy_flash.jax_adapter import flash_decode

    keys = jax.random.split(jax.random.PRNGKey(5), 5)
    pages, page, heads_kv, d = 10, 32, 2, 64
    q = jax.random.normal(keys[0], (2, 1, 8, d), jnp.bfloat16)
    k_cache, v_cache = (jax.random.normal(key, (pages, page, heads_kv, d), jnp.float32).astype(jnp.float8_e4m3fn)
                        for key in keys[1:3])
    k_new, v_new = (jax.random.normal(key, (2, 1, heads_kv, d), jnp.bfloat16) for key in keys[3:5])
    angles = numpy.arange(160)[:, None] * 0.01 * (numpy.arange(16) + 1)[None, :]
    options = dict(block_table=jnp.asarray([[3, 1, 7, 0, 9], [2, 8, 4, 6, 5]], jnp.int32),
                   cache_leftpad=jnp.asarray([5, 0], jnp.int32), rotary_cos=jnp.asarray(numpy.cos(angles), jnp.bfloat16),
                   rotary_sin=jnp.asarray(numpy.sin(angles), jnp.bfloat16), k_descale=jnp.asarray([0.5, 2.0], jnp.float32),
                   v_descale=jnp.asarray([[1.0, 0.25], [3.0, 1.5]], jnp.float32))
    lengths = jnp.asarray([40, 130], jnp.int32)
    ck, cv = (_as_cupy(jax.lax.bitcast_convert_type(x, jnp.uint8)).copy() for x in (k_cache, v_cache))
    expected = cupy_flash.flash_decode(_as_cupy(q), ck, cv, cache_seqlens=_as_cupy(lengths), k_new=_as_cupy(k_new),
                                       v_new=_as_cupy(v_new), causal=True,
                                       **{name: _as_cupy(x) for name, x in options.items()})[0]
    step = jax.jit(lambda q, kc, vc, n, kn, vn: flash_decode(q, kc, vc, n, kn, vn, causal=True, **options))
    o, k_cache, v_cache = step(q, k_cache, v_cache, lengths, k_new, v_new)
    assert bool((bitwise(_as_cupy(o)) == bitwise(expected)).all())
    for ours, theirs in ((k_cache, ck), (v_cache, cv)):
        assert bool((_as_cupy(jax.lax.bitcast_convert_type(ours, jnp.uint8)) == theirs).all())


def test_torch_compile_fullgraph_has_no_graph_breaks_and_equals_eager():
    torch = torch_on_gpu()
    from cupy_flash.torch_adapter import flash_attn_func

    torch.manual_seed(0)
    block = torch.nn.Linear(256, 3 * 256, device="cuda", dtype=torch.bfloat16)

    def attention_block(x):
        q, k, v = block(x).view(x.shape[0], x.shape[1], 3, 4, 64).unbind(2)
        return flash_attn_func(q, k, v, causal=True).reshape(x.shape) * 2 + x

    x = torch.randn(2, 300, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    explanation = torch._dynamo.explain(attention_block)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(attention_block, fullgraph=True)
    outputs = {}
    for name, fn in (("eager", attention_block), ("compiled", compiled)):
        x.grad, block.weight.grad = None, None
        y = fn(x)
        y.float().square().sum().backward()
        outputs[name] = (y.detach(), x.grad.clone(), block.weight.grad.clone())
    for a, b, label in zip(outputs["eager"], outputs["compiled"], ("y", "dx", "dweight")):
        error = float((a.float() - b.float()).abs().max())
        assert error <= 0.02 * float(a.float().abs().max()), (label, error)   # compiled matmuls may round differently


def test_torch_custom_ops_capture_in_a_cuda_graph():
    torch = torch_on_gpu()
    from cupy_flash.torch_adapter import flash_attn_func

    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(2, 200, 4, 64, device="cuda", dtype=torch.float16, generator=gen).requires_grad_()
               for _ in range(3))
    do = torch.randn(2, 200, 4, 64, device="cuda", dtype=torch.float16, generator=gen)

    def step():   # deterministic: the replay and a fresh call are compared bitwise
        q.grad = k.grad = v.grad = None
        o = flash_attn_func(q, k, v, causal=True, deterministic=True)
        o.backward(do)
        return o.detach().clone(), q.grad.clone(), k.grad.clone(), v.grad.clone()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            eager = step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    q.grad = k.grad = v.grad = None
    with torch.cuda.graph(graph):
        captured = step()
    with torch.no_grad():
        for x in (q, k, v):
            x.mul_(0.5)
    graph.replay()
    torch.cuda.synchronize()
    fresh = step()
    for a, b, label in zip(captured, fresh, ("o", "dq", "dk", "dv")):
        assert torch.equal(a, b), label   # the replay read the new inputs and wrote the captured outputs
    assert not torch.equal(captured[0], eager[0])


def test_torch_compile_reduce_overhead_replays_equal_eager():
    """torch.compile(mode="reduce-overhead") runs the ops inside CUDA graphs whose memory pool may hold
    nothing past a call: a tile counter kept from a warm-up inside the pool stopped it ("tensor(s) in
    the cudagraph pool not tracked as outputs"). Warm-up, recording and replays on new inputs each
    equal eager calls bit for bit, forward and backward (deterministic), on the Hopper path and the
    portable one."""
    torch = torch_on_gpu()
    from cupy_flash import families
    from cupy_flash.torch_adapter import flash_attn_func

    gen = torch.Generator(device="cuda").manual_seed(2)
    for setting in ("auto", "portable"):
        torch._dynamo.reset()
        attention = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, causal=True, deterministic=True),
                                  fullgraph=True, mode="reduce-overhead")
        for call in range(4):   # warm-up, recording, replays
            q, k, v = (torch.randn(2, 300, 4, 64, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
                       for _ in range(3))
            do = torch.randn(2, 300, 4, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
            with families.use_kernels(setting):
                o = attention(q, k, v)
                o.backward(do)
                got = (o.detach().clone(), q.grad.clone(), k.grad.clone(), v.grad.clone())
                again = [x.detach().clone().requires_grad_() for x in (q, k, v)]
                o_eager = flash_attn_func(*again, causal=True, deterministic=True)
                o_eager.backward(do)
            for a, b, label in zip(got, (o_eager.detach(), *(x.grad for x in again)), ("o", "dq", "dk", "dv")):
                assert torch.equal(a, b), (setting, call, label)


def test_torch_ops_fake_implementations_give_the_real_shapes():
    torch = torch_on_gpu()
    from torch._subclasses.fake_tensor import FakeTensorMode

    import cupy_flash.torch_adapter  # noqa: F401 - registers the ops

    args = [torch.randn(3, 70, 4, 64, device="cuda", dtype=torch.float16), torch.randn(3, 90, 2, 64, device="cuda", dtype=torch.float16)]
    real = torch.ops.cupy_flash.forward(args[0], args[1], args[1], None, None, None, None, None, None, None, None, True,
                                        None, 0.0, False)
    with FakeTensorMode() as mode:
        fakes = [mode.from_tensor(x) for x in args]
        fake = torch.ops.cupy_flash.forward(fakes[0], fakes[1], fakes[1], None, None, None, None, None, None, None, None,
                                            True, None, 0.0, False)
    assert [tuple(x.shape) for x in fake] == [tuple(x.shape) for x in real]
    assert [x.dtype for x in fake] == [x.dtype for x in real]


@pytest.mark.parametrize("d, d_v", [(192, 128), (59, 111)])
def test_adapters_take_v_with_its_own_head_dim(d, d_v):
    """d_qk 192 / d_v 128 (DeepSeek's), and 59 / 111 (padded inside): the PyTorch adapter (eager and
    compiled) and the JAX adapter (jit) give bitwise the direct calls' o and (deterministic)
    gradients, and the fake implementation o's shape."""
    import cupy

    from cupy_flash._checks import as_gpu_array

    torch, jax = torch_on_gpu(), jax_on_gpu()
    from torch._subclasses.fake_tensor import FakeTensorMode

    from cupy_flash.jax_adapter import flash_attention
    from cupy_flash.torch_adapter import flash_attn_func

    generator = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 300, 4, d, device="cuda", dtype=torch.bfloat16, generator=generator)
    k = torch.randn(2, 333, 2, d, device="cuda", dtype=torch.bfloat16, generator=generator)
    v = torch.randn(2, 333, 2, d_v, device="cuda", dtype=torch.bfloat16, generator=generator)
    do = torch.randn(2, 300, 4, d_v, device="cuda", dtype=torch.bfloat16, generator=generator)
    cq, ck, cv, cdo = (as_gpu_array("x", x) for x in (q, k, v, do))
    o_direct, lse = cupy_flash.flash_forward(cq, ck, cv, causal=True)
    grads_direct = cupy_flash.flash_backward(cdo, cq, ck, cv, o_direct, lse, causal=True, deterministic=True)
    assert o_direct.shape == (2, 300, 4, d_v) and grads_direct[2].shape == cv.shape
    expected = (o_direct,) + tuple(grads_direct)

    def torch_call(q, k, v):
        return flash_attn_func(q, k, v, causal=True, deterministic=True)

    for label, function in (("eager", torch_call), ("compiled", torch.compile(torch_call, fullgraph=True))):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        o = function(*leaves)
        o.backward(do)
        for name, ours, want in zip(("o", "dq", "dk", "dv"), (o.detach(), *(x.grad for x in leaves)), expected):
            assert bool(cupy.array_equal(bitwise(as_gpu_array(name, ours)), bitwise(want))), (label, name)
    with FakeTensorMode() as mode:
        fake = torch.ops.cupy_flash.forward(*(mode.from_tensor(x) for x in (q, k, v)), None, None, None, None, None,
                                            None, None, None, True, None, 0.0, False)
    assert tuple(fake[0].shape) == (2, 300, 4, d_v)

    jq, jk, jv, jdo = (jax.dlpack.from_dlpack(x) for x in (q, k, v, do))

    @jax.jit
    def value_and_grads(q, k, v, do):
        o, vjp = jax.vjp(lambda q, k, v: flash_attention(q, k, v, causal=True, deterministic=True), q, k, v)
        return (o,) + vjp(do)

    for name, ours, want in zip(("o", "dq", "dk", "dv"), value_and_grads(jq, jk, jv, jdo), expected):
        assert bool(cupy.array_equal(bitwise(as_gpu_array(name, ours)), bitwise(want))), ("jax", name)


def _mesh_of_gpus(jax, axis: str):
    """(a mesh of every GPU, 4 at most, over ``axis``; its size), or a skip below two GPUs."""
    from jax.sharding import Mesh

    devices = [device for device in jax.devices() if device.platform == "gpu"]
    if len(devices) < 2:
        pytest.skip("context parallelism under JAX needs two GPUs (a mesh axis)")
    world = 4 if len(devices) >= 4 else 2
    return Mesh(numpy.array(devices[:world]), (axis,)), world


RING_OPTIONS = [dict(causal=False), dict(causal=True), dict(causal=True, window_size=(300, 0), softcap=20.0),
                dict(causal=False, window_size=(200, 150))]


@pytest.mark.parametrize("options", RING_OPTIONS, ids=["full", "causal", "causal-window-softcap", "window"])
def test_jax_ring_attention_matches_the_reference(options):
    """jax_adapter.ring_attention under jax.jit over a mesh of every GPU (2 or 4; zigzag shards, GQA):
    o and the gradients through the ring against the float64 reference of the unsplit sequence, with
    the 2x / 3x rule; windows over global positions (bands across chunks and ranks) and softcap."""
    jax = jax_on_gpu()
    import jax.numpy as jnp
    import ml_dtypes
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from cupy_flash.distributed import zigzag_indices
    from cupy_flash.jax_adapter import ring_attention, shard_map

    mesh, world = _mesh_of_gpus(jax, "ring")
    batch, seqlen, heads, heads_kv, d = 2, 512 * world, 4, 2, 64
    causal = options["causal"]
    rng = numpy.random.default_rng(world + len(options) + causal)
    q, k, v, w = (rng.standard_normal((batch, seqlen, h, d), dtype=numpy.float32).astype(ml_dtypes.bfloat16)
                  for h in (heads, heads_kv, heads_kv, heads))
    index = zigzag_indices(seqlen, world) if len(options) > 1 or causal else numpy.arange(seqlen)
    back = numpy.argsort(index)
    sharding = NamedSharding(mesh, P(None, "ring"))
    qz, kz, vz, wz = (jax.device_put(jnp.asarray(x[:, index]), sharding) for x in (q, k, v, w))
    spec = P(None, "ring")
    ring = shard_map(lambda q, k, v: ring_attention(q, k, v, "ring", **options), mesh, (spec,) * 3, spec)
    o = numpy.asarray(jax.jit(ring)(qz, kz, vz))[:, back]

    def loss(q, k, v):
        return (ring(q, k, v).astype(jnp.float32) * wz.astype(jnp.float32)).sum()

    grads = [numpy.asarray(g)[:, back] for g in jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(qz, kz, vz)]
    exact = attention_reference(q, k, v, **options)[0]
    low = attention_reference(q, k, v, upcast=False, **options)[0]
    context = f"world={world} {options}"
    check_error_rule("ring o", o, exact, low, context)
    exact_grads = attention_reference_backward(w, q, k, v, **options)
    low_grads = attention_reference_backward(w, q, k, v, upcast=False, **options)
    for name, ours, e, lo in zip(("dq", "dk", "dv"), grads, exact_grads, low_grads):
        check_error_rule(f"ring {name}", ours, e, lo, context, factor=3.0)


@pytest.mark.parametrize("options", [dict(causal=True), dict(window_size=(300, 0), softcap=20.0)], ids=["causal", "window"])
def test_jax_ulysses_attention_matches_the_reference(options):
    """jax_adapter.ulysses_attention (all-to-all over the heads) under jax.jit over a mesh of every GPU
    (2 or 4; contiguous shards, GQA 8 / 4): o and the gradients against the float64 reference with the
    2x / 3x rule, the variants included; K/V heads that do not divide over the ranks are refused."""
    jax = jax_on_gpu()
    import jax.numpy as jnp
    import ml_dtypes
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from cupy_flash.jax_adapter import shard_map, ulysses_attention

    mesh, world = _mesh_of_gpus(jax, "sp")
    batch, seqlen, heads, heads_kv, d = 2, 512 * world, 8, 4, 64
    rng = numpy.random.default_rng(world)
    q, k, v, w = (rng.standard_normal((batch, seqlen, h, d), dtype=numpy.float32).astype(ml_dtypes.bfloat16)
                  for h in (heads, heads_kv, heads_kv, heads))
    spec = P(None, "sp")
    sharding = NamedSharding(mesh, spec)
    qs, ks, vs, ws = (jax.device_put(jnp.asarray(x), sharding) for x in (q, k, v, w))
    attention = shard_map(lambda q, k, v: ulysses_attention(q, k, v, "sp", **options), mesh, (spec,) * 3, spec)
    o = numpy.asarray(jax.jit(attention)(qs, ks, vs))

    def loss(q, k, v):
        return (attention(q, k, v).astype(jnp.float32) * ws.astype(jnp.float32)).sum()

    grads = [numpy.asarray(g) for g in jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(qs, ks, vs)]
    exact = attention_reference(q, k, v, **options)[0]
    low = attention_reference(q, k, v, upcast=False, **options)[0]
    context = f"world={world} {options}"
    check_error_rule("ulysses o", o, exact, low, context)
    for name, ours, e, lo in zip(("dq", "dk", "dv"), grads, attention_reference_backward(w, q, k, v, **options),
                                 attention_reference_backward(w, q, k, v, upcast=False, **options)):
        check_error_rule(f"ulysses {name}", ours, e, lo, context, factor=3.0)
    one_kv = shard_map(lambda q, k, v: ulysses_attention(q, k[:, :, :1], v[:, :, :1], "sp"), mesh, (spec,) * 3, spec)
    with pytest.raises(ValueError, match="k has 1 heads, not a multiple of the"):
        jax.jit(one_kv)(qs, ks, vs)


def test_torch_flash_attn_with_kvcache_is_flash_decode():
    """torch_adapter.flash_attn_with_kvcache (FlashAttention-2's signature: rotary interleaved by
    default, num_splits 0, an int cache_seqlens) on a paged cache with new tokens, and on an FP8
    cache: bitwise flash_decode on copies, the caches updated alike, lse when asked for."""
    torch = torch_on_gpu()
    import cupy

    from cupy_flash.torch_adapter import flash_attn_with_kvcache

    torch.manual_seed(0)
    dev = "cuda"
    q = torch.randn(2, 1, 8, 64, device=dev, dtype=torch.bfloat16)
    k_cache, v_cache = (torch.randn(12, 16, 2, 64, device=dev, dtype=torch.bfloat16) for _ in range(2))
    k_new, v_new = (torch.randn(2, 1, 2, 64, device=dev, dtype=torch.bfloat16) for _ in range(2))
    table = torch.tensor([[3, 1, 7, 0, 9], [2, 8, 4, 6, 5]], dtype=torch.int32, device=dev)
    angles = torch.arange(80, device=dev)[:, None] * 0.01 * (torch.arange(16, device=dev) + 1)[None, :]
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    ck, cv = (_as_cupy_torch(x).copy() for x in (k_cache, v_cache))
    expected, expected_lse = cupy_flash.flash_decode(_as_cupy_torch(q), ck, cv, cache_seqlens=cupy.full(2, 40, cupy.int32),
                                                     k_new=_as_cupy_torch(k_new), v_new=_as_cupy_torch(v_new),
                                                     block_table=_as_cupy_torch(table), rotary_cos=_as_cupy_torch(cos),
                                                     rotary_sin=_as_cupy_torch(sin), rotary_interleaved=True, causal=True)
    o, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin, cache_seqlens=40,
                                     block_table=table, causal=True, return_softmax_lse=True)
    assert o.shape == q.shape and lse.shape == (2, 8, 1)
    assert bool((bitwise(_as_cupy_torch(o)) == bitwise(expected)).all())
    assert bool((_as_cupy_torch(lse) == expected_lse).all())
    assert bool((bitwise(_as_cupy_torch(k_cache)) == bitwise(ck)).all()) and bool((bitwise(_as_cupy_torch(v_cache)) == bitwise(cv)).all())
    # An FP8 cache (torch.float8_e4m3fn) with descales per K/V head.
    k8, v8 = (torch.randn(2, 64, 2, 64, device=dev).to(torch.float8_e4m3fn) for _ in range(2))
    descale = torch.tensor([0.5, 2.0], device=dev)
    expected = cupy_flash.flash_decode(_as_cupy_torch(q), _as_cupy_torch(k8.view(torch.uint8)).copy(),
                                       _as_cupy_torch(v8.view(torch.uint8)).copy(), cache_seqlens=cupy.full(2, 50, cupy.int32),
                                       k_descale=_as_cupy_torch(descale), v_descale=_as_cupy_torch(descale))[0]
    o = flash_attn_with_kvcache(q, k8, v8, cache_seqlens=50, k_descale=descale, v_descale=descale)
    assert bool((bitwise(_as_cupy_torch(o)) == bitwise(expected)).all())


def test_torch_flash_mla_with_kvcache_is_the_mla_kernel():
    """torch_adapter.flash_mla_with_kvcache (FlashMLA's signature, get_mla_metadata's placeholders):
    bitwise flash_decode with v a view of the paged latent cache (the MLA kernel), out and lse in
    FlashMLA's shapes; a head_dim_v past k's head dim is refused by name."""
    torch = torch_on_gpu()
    from cupy_flash.torch_adapter import flash_mla_with_kvcache, get_mla_metadata

    torch.manual_seed(1)
    dev = "cuda"
    q = torch.randn(2, 2, 64, 576, device=dev, dtype=torch.bfloat16)
    k_cache = torch.randn(12, 64, 1, 576, device=dev, dtype=torch.bfloat16)
    table = torch.tensor([[3, 1, 7, 0, 9, 2], [11, 8, 4, 6, 5, 10]], dtype=torch.int32, device=dev)
    lengths = torch.tensor([300, 37], dtype=torch.int32, device=dev)
    metadata, splits = get_mla_metadata(lengths, 2 * 64, 1)
    ck = _as_cupy_torch(k_cache)
    expected, expected_lse = cupy_flash.flash_decode(_as_cupy_torch(q), ck, ck[..., :512], cache_seqlens=_as_cupy_torch(lengths),
                                                     block_table=_as_cupy_torch(table), causal=True, softmax_scale=0.07)
    o, lse = flash_mla_with_kvcache(q, k_cache, table, lengths, 512, metadata, splits, softmax_scale=0.07, causal=True)
    assert o.shape == (2, 2, 64, 512) and lse.shape == (2, 64, 2)
    assert bool((bitwise(_as_cupy_torch(o)) == bitwise(expected)).all())
    assert bool((_as_cupy_torch(lse) == expected_lse).all())
    with pytest.raises(ValueError, match="head_dim_v is 600"):
        flash_mla_with_kvcache(q, k_cache, table, lengths, 600)


def _as_cupy_torch(x):
    """A CuPy view of a CUDA tensor (bfloat16 through its bits)."""
    import cupy
    import ml_dtypes
    import torch

    if x.dtype == torch.bfloat16:
        return cupy.from_dlpack(x.view(torch.int16)).view(ml_dtypes.bfloat16)
    return cupy.from_dlpack(x)
