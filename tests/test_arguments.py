"""Bad arguments raise TypeError/ValueError naming the argument, before any launch.

The same table runs twice: on CPU through the public functions with NumPy arrays standing in for
GPU arrays (only the one GPU-bound step, taking the array, is replaced), and on the GPU with CuPy
arrays, where it also checks that no input was modified."""

import ml_dtypes
import numpy
import pytest
from helpers import bitwise, requires_gpu

import cupy_flash
from cupy_flash import _checks

B, NQ, NK, H, D = 2, 5, 7, 3, 16


def good(xp, dtype=numpy.float16):
    rng = numpy.random.default_rng(0)
    q = rng.standard_normal((B, NQ, H, D)).astype(dtype)
    k = rng.standard_normal((B, NK, H, D)).astype(dtype)
    v = rng.standard_normal((B, NK, H, D)).astype(dtype)
    do = rng.standard_normal((B, NQ, H, D)).astype(dtype)
    o = rng.standard_normal((B, NQ, H, D)).astype(dtype)
    lse = rng.standard_normal((B, H, NQ)).astype(numpy.float32)
    arrays = dict(q=q, k=k, v=v, do=do, o=o, lse=lse)
    return {n: xp.asarray(a) for n, a in arrays.items()}


def packed(a):
    """The good arguments as a packed batch of B sequences (total, heads, d); lse (heads, total)."""
    rows = {n: a[n].reshape(-1, H, D) for n in ("q", "k", "v", "do", "o")}
    return {**rows, "lse": a["lse"].transpose(1, 0, 2).reshape(H, B * NQ)}


CU = numpy.array([0, NQ, B * NQ], numpy.int32)
CU_K = numpy.array([0, NK, B * NK], numpy.int32)


def paged(a, page_size=16):
    """Packed q with k and v as a paged cache: B pages of page_size keys (sequence b in page b)."""
    cache = {n: a[n].repeat(-(-page_size // NK), axis=1)[:, :page_size] for n in ("k", "v")}
    return {**packed(a), **cache}


TABLE = numpy.arange(B, dtype=numpy.int32).reshape(B, 1)
PAGED = {"cu_seqlens_q": CU, "cu_seqlens_k": CU_K, "block_table": TABLE}

# (id, change to the good arguments, options, exception, text the message must contain)
CASES = [
    ("q-rank", lambda a: {"q": a["q"][0]}, {}, ValueError, "q must have 4 dimensions"),
    ("k-rank", lambda a: {"k": a["k"][..., None]}, {}, ValueError, "k must have 4 dimensions"),
    ("q-dtype-int", lambda a: {n: a[n].astype(numpy.int32) for n in "qkv"}, {}, TypeError, "q has dtype int32"),
    ("q-dtype-float64", lambda a: {n: a[n].astype(numpy.float64) for n in "qkv"}, {}, TypeError, "q has dtype float64"),
    ("k-dtype-mixed", lambda a: {"k": a["k"].astype(numpy.float32)}, {}, TypeError, "k has dtype float32 but q has dtype float16"),
    ("v-dtype-mixed", lambda a: {"v": a["v"].astype(numpy.float32)}, {}, TypeError, "v has dtype float32"),
    ("head-dim-mismatch", lambda a: {"k": a["k"][..., :8], "v": a["v"][..., :8]}, {}, ValueError, "k has head_dim 8 but q has head_dim 16"),
    ("batch-mismatch", lambda a: {"k": a["k"][:1], "v": a["v"][:1]}, {}, ValueError, "k has batch 1 but q has batch 2"),
    ("v-shape", lambda a: {"v": a["v"][:, :3]}, {}, ValueError, "v has shape"),
    ("heads-not-a-divisor", lambda a: {"k": a["k"][:, :, :2], "v": a["v"][:, :, :2]}, {}, ValueError, "k has 2 heads but q has 3"),
    # Head dims off 16-byte rows are padded inside (_padding), after their own checks.
    ("head-dim-padded-mismatch", lambda a: {"q": a["q"][..., :12], "k": a["k"][..., :13]}, {}, ValueError,
     "k has head_dim 13 but q has head_dim 12"),
    ("head-dim-zero", lambda a: {n: a[n][..., :0] for n in "qkv"}, {}, ValueError, "q has head_dim 0; expected"),
    ("v-head-dim-too-big", lambda a: {"v": a["v"].repeat(33, axis=3)}, {}, ValueError, "v has head_dim 528"),
    ("v-seqlen", lambda a: {"v": a["v"][:, :3, :, :8]}, {}, ValueError, "they must match but in the head_dim"),
    ("head-dim-too-big", lambda a: {n: a[n].repeat(33, axis=3) for n in "qkv"}, {}, ValueError, "head_dim 528"),
    ("seqlen-zero", lambda a: {"q": a["q"][:, :0]}, {}, ValueError, "seqlen_q is 0"),
    ("scale-string", lambda a: {}, {"softmax_scale": "0.1"}, TypeError, "softmax_scale must be a real number"),
    ("scale-bool", lambda a: {}, {"softmax_scale": True}, TypeError, "softmax_scale"),
    ("scale-nan", lambda a: {}, {"softmax_scale": float("nan")}, ValueError, "softmax_scale must be a finite positive"),
    ("scale-negative", lambda a: {}, {"softmax_scale": -0.5}, ValueError, "softmax_scale must be a finite positive"),
    ("causal-int", lambda a: {}, {"causal": 1}, TypeError, "causal must be a bool"),
    ("window-type", lambda a: {}, {"window_size": 5}, TypeError, "window_size must be a pair"),
    ("window-negative", lambda a: {}, {"window_size": (-2, 0)}, ValueError, "window_size left is -2"),
    ("window-float", lambda a: {}, {"window_size": (1.5, 0)}, TypeError, "window_size left must be an int"),
    ("softcap-negative", lambda a: {}, {"softcap": -1.0}, ValueError, "softcap must be finite and >= 0"),
    ("softcap-str", lambda a: {}, {"softcap": "1"}, TypeError, "softcap must be a real number"),
    ("alibi-shape", lambda a: {}, {"alibi_slopes": numpy.ones((H + 1,), numpy.float32)}, ValueError,
     "alibi_slopes has shape (4,); expected (heads_q,) or (batch, heads_q)"),
    ("alibi-dtype", lambda a: {}, {"alibi_slopes": numpy.ones((H,), numpy.int32)}, TypeError, "alibi_slopes has dtype int32"),
    ("sink-shape", lambda a: {}, {"sink": numpy.ones((B, H), numpy.float32)}, ValueError, "sink has shape (2, 3); expected (heads_q,)"),
    ("sink-list", lambda a: {}, {"sink": [0.0] * H}, TypeError, "sink must be"),
    ("bias-shape", lambda a: {}, {"bias": numpy.zeros((NQ + 1, NK), numpy.float32)}, ValueError,
     "bias has shape (6, 7), which does not broadcast to (batch, heads_q, seqlen_q, seqlen_k) = (2, 3, 5, 7)"),
    ("bias-rank", lambda a: {}, {"bias": numpy.zeros((1, B, H, NQ, NK), numpy.float32)}, ValueError, "does not broadcast"),
    ("bias-dtype", lambda a: {}, {"bias": numpy.zeros((NQ, NK), numpy.int32)}, TypeError, "bias has dtype int32"),
    ("bias-list", lambda a: {}, {"bias": [[0.0] * NK] * NQ}, TypeError, "bias must be a"),
    # Packed (variable-length) batches: q, k, v as (total, heads, d).
    ("packed-one-cu", packed, {"cu_seqlens_q": CU}, ValueError, "cu_seqlens_k is missing"),
    ("packed-rank", lambda a: {}, {"cu_seqlens_q": CU, "cu_seqlens_k": CU}, ValueError,
     "q must have 3 dimensions (total_tokens, heads, head_dim) with cu_seqlens"),
    ("packed-cu-dtype", packed, {"cu_seqlens_q": CU.astype(numpy.int64), "cu_seqlens_k": CU_K}, TypeError,
     "cu_seqlens_q has dtype int64; expected int32"),
    ("packed-cu-start", packed, {"cu_seqlens_q": CU + 1, "cu_seqlens_k": CU_K}, ValueError, "cu_seqlens_q must start at 0"),
    ("packed-cu-decreasing", packed, {"cu_seqlens_q": numpy.array([0, 7, 3], numpy.int32),
                                      "cu_seqlens_k": CU_K}, ValueError, "cu_seqlens_q must be non-decreasing"),
    ("packed-cu-total", packed, {"cu_seqlens_q": CU, "cu_seqlens_k": CU_K - numpy.array([0, 0, 1], numpy.int32)}, ValueError,
     f"cu_seqlens_k ends at {B * NK - 1} but k has {B * NK} rows"),
    ("packed-cu-batch", packed, {"cu_seqlens_q": CU, "cu_seqlens_k": numpy.array([0, B * NK], numpy.int32)}, ValueError,
     "cu_seqlens_q has shape (3,) but cu_seqlens_k has shape (2,)"),
    ("packed-max-short", packed, {"cu_seqlens_q": CU, "cu_seqlens_k": CU_K, "max_seqlen_q": NQ - 1}, ValueError,
     f"max_seqlen_q is {NQ - 1} but the longest sequence has {NQ} rows"),
    ("packed-max-alone", lambda a: {}, {"max_seqlen_q": NQ}, ValueError, "max_seqlen_q is only meaningful with cu_seqlens"),
    ("packed-with-bias", packed, {"cu_seqlens_q": CU, "cu_seqlens_k": CU_K, "bias": numpy.zeros((NQ, NK), numpy.float32)},
     ValueError, "bias is not supported with cu_seqlens_q"),
    ("unknown-option", lambda a: {}, {"window": (1, 1)}, TypeError, "unsupported keyword argument(s): window"),
]
BACKWARD_CASES = [
    ("do-shape", lambda a: {"do": a["do"][:, :2]}, {}, ValueError, "do has shape"),
    ("do-dtype", lambda a: {"do": a["do"].astype(numpy.float32)}, {}, TypeError, "do has dtype float32"),
    ("o-shape", lambda a: {"o": a["o"][:1]}, {}, ValueError, "o has shape"),
    ("o-dtype", lambda a: {"o": a["o"].astype(numpy.float32)}, {}, TypeError, "o has dtype float32"),
    ("lse-shape", lambda a: {"lse": a["lse"][:, :, :2]}, {}, ValueError, "lse has shape"),
    ("lse-layout", lambda a: {"lse": a["lse"].reshape(B, NQ, H)}, {}, ValueError, "expected (batch, heads, seqlen_q)"),
    ("lse-dtype", lambda a: {"lse": a["lse"].astype(numpy.float16)}, {}, TypeError, "lse has dtype float16"),
    ("deterministic-str", lambda a: {}, {"deterministic": "yes"}, TypeError, "deterministic must be a bool"),
    ("dbias-without-bias", lambda a: {}, {"return_dbias": True}, ValueError, "return_dbias=True needs the bias"),
    ("dbias-str", lambda a: {}, {"return_dbias": "yes", "bias": numpy.zeros((NQ, NK), numpy.float32)}, TypeError,
     "return_dbias must be a bool"),
    ("dbias-deterministic-broadcast", lambda a: {}, {"return_dbias": True, "deterministic": True,
                                                     "bias": numpy.zeros((NQ, NK), numpy.float32)}, ValueError,
     "deterministic=True with return_dbias=True needs a bias that is not summed over"),
    ("packed-lse-layout", lambda a: {**packed(a), "lse": packed(a)["lse"].T}, {"cu_seqlens_q": CU, "cu_seqlens_k": CU_K},
     ValueError, "expected (heads, total_q)"),
    ("packed-do-shape", lambda a: {**packed(a), "do": a["do"]}, {"cu_seqlens_q": CU, "cu_seqlens_k": CU_K}, ValueError,
     "do has shape"),
    # v's head_dim (8) differs from q's (16): do and o take it.
    ("do-head-dim-v", lambda a: {"v": a["v"][..., :8], "o": a["o"][..., :8]}, {}, ValueError,
     f"do has shape {(B, NQ, H, D)}; expected o's {(B, NQ, H, 8)} (q's, with v's head_dim)"),
    ("o-head-dim-v", lambda a: {"v": a["v"][..., :8], "do": a["do"][..., :8]}, {}, ValueError, "o has shape"),
]


def call_forward(a, options):
    return cupy_flash.flash_forward(a["q"], a["k"], a["v"], **options)


def call_backward(a, options):
    return cupy_flash.flash_backward(a["do"], a["q"], a["k"], a["v"], a["o"], a["lse"], **options)


FORWARD_CASES = [
    ("return-dbias", lambda a: {}, {"return_dbias": True}, TypeError, "unsupported keyword argument(s): return_dbias"),
    # A paged cache for a packed batch (block_table): flash_decode's page rules.
    ("paged-without-cu", lambda a: {}, {"block_table": TABLE}, ValueError,
     "cu_seqlens_q is missing: packed batches need both cu_seqlens_q and cu_seqlens_k (block_table pages"),
    ("paged-k-rank", packed, PAGED, ValueError,
     "k must have 4 dimensions (pages, page_size, heads, head_dim) with block_table"),
    ("paged-float32", lambda a: {n: x.astype(numpy.float32) for n, x in paged(a).items() if n in "qkv"}, PAGED,
     TypeError, "block_table takes float16 or bfloat16 inputs; q has dtype float32"),
    ("paged-page-size", lambda a: paged(a, 8), PAGED, ValueError,
     "k has pages of 8 keys (its axis 1); a paged cache needs a power of two from 16 up"),
    ("paged-table-dtype", paged, {**PAGED, "block_table": TABLE.astype(numpy.int64)}, TypeError,
     "block_table has dtype int64; expected int32"),
    ("paged-table-batch", paged, {**PAGED, "block_table": TABLE[:1]}, ValueError,
     "block_table has shape (1, 1); expected (batch, pages per sequence) with batch 2"),
    ("paged-too-long", paged, {**PAGED, "cu_seqlens_k": numpy.array([0, 17, 20], numpy.int32)}, ValueError,
     "cu_seqlens_k gives a sequence 17 keys but block_table holds 16 per sequence (1 pages of 16)"),
]
BACKWARD_ONLY_CASES = [
    ("paged", paged, PAGED, ValueError, "block_table is not supported by flash_backward"),
]
ALL = ([("forward",) + c for c in CASES + FORWARD_CASES] + [("backward",) + c for c in CASES]
       + [("backward",) + c for c in BACKWARD_CASES + BACKWARD_ONLY_CASES])


def _run(xp, kind, change, options, error, text):
    """Call with one bad argument; check the error. Returns (arrays passed, their snapshot)."""
    arrays = good(xp)
    arrays.update(change(arrays))
    snapshot = {n: a.copy() for n, a in arrays.items()}
    # Feature arrays (alibi_slopes, sink) live where q does.
    options = {n: xp.asarray(x) if isinstance(x, numpy.ndarray) else x for n, x in options.items()}
    call = call_forward if kind == "forward" else call_backward
    with pytest.raises(error) as info:
        call(arrays, options)
    assert text in str(info.value)
    return arrays, snapshot


@pytest.mark.parametrize("kind,name,change,options,error,text", ALL, ids=[f"{c[0]}-{c[1]}" for c in ALL])
def test_bad_arguments_cpu(monkeypatch, kind, name, change, options, error, text):
    # Replace only the step that takes a GPU array, so NumPy arrays reach every other check.
    monkeypatch.setattr(_checks, "as_gpu_array", lambda _name, x: x)
    _run(numpy, kind, change, options, error, text)


@pytest.mark.parametrize("which", ["q", "k", "v", "do", "o", "lse"])
def test_host_arrays_are_rejected(which):
    with pytest.raises(TypeError, match=f"{which} is a NumPy array in host memory"):
        _checks.as_gpu_array(which, numpy.zeros((1, 1, 1, 8), numpy.float16))
    with pytest.raises(TypeError, match="q is a NumPy array in host memory"):
        cupy_flash.flash_forward(*(numpy.zeros((1, 1, 1, 8), numpy.float16),) * 3)


def test_non_arrays_are_rejected():
    with pytest.raises(TypeError, match="q must be a CuPy array"):
        cupy_flash.flash_forward([[1.0]], None, None)


def test_bfloat16_is_accepted_by_the_checks():
    arrays = good(numpy, ml_dtypes.bfloat16)
    shape = _checks.check_qkv(arrays["q"], arrays["k"], arrays["v"])
    assert shape.dtype == "bfloat16" and shape.tile == 32


def test_v_may_have_its_own_head_dim(monkeypatch):
    """v's head_dim (o's) may differ from q's and k's: the shape says which tile the kernels take,
    and the variant carries the flag that makes them read it (FEATURE_HEAD_DIM_V)."""
    from cupy_flash._features import FEATURE_HEAD_DIM_V

    monkeypatch.setattr(_checks, "as_gpu_array", lambda _name, x: x)
    arrays = good(numpy)
    v = numpy.zeros((B, NK, H, 248), numpy.float16)
    *_, shape, _, variant = _checks.prepare_qkv(arrays["q"], arrays["k"], v, None, True)
    assert (shape.head_dim, shape.head_dim_v, shape.widest_head_dim, shape.tile) == (D, 248, 248, 256)
    assert variant.flags == FEATURE_HEAD_DIM_V and variant.causal
    *_, shape, _, variant = _checks.prepare_qkv(arrays["q"], arrays["k"], arrays["v"], None, True)
    assert shape.head_dim_v == shape.head_dim == D and variant.flags == 0 and variant.plain
    with pytest.raises(ValueError, match="FP8 calls take one head_dim"):
        _checks.check_qkv(*(numpy.zeros((1, 4, 1, n), numpy.uint8) for n in (32, 32, 16)), fp8=True)


def test_grid_limit_is_checked():
    q = numpy.lib.stride_tricks.as_strided(numpy.zeros(1, numpy.float16), (1 << 20, 4096, 16, 64), (0, 0, 0, 2))
    with pytest.raises(ValueError, match="grid limit"):
        _checks.check_qkv(q, q, q)


@requires_gpu
@pytest.mark.parametrize("kind,name,change,options,error,text", ALL, ids=[f"{c[0]}-{c[1]}" for c in ALL])
def test_bad_arguments_gpu(kind, name, change, options, error, text):
    import cupy

    arrays, snapshot = _run(cupy, kind, change, options, error, text)
    for n, a in arrays.items():
        assert bool(cupy.array_equal(bitwise(a), bitwise(snapshot[n]))), f"{n} was modified"


@requires_gpu
@pytest.mark.parametrize("deterministic", [False, True])
def test_valid_calls_leave_inputs_untouched(deterministic):
    import cupy

    arrays = good(cupy)
    snapshot = {n: a.copy() for n, a in arrays.items()}
    call_forward(arrays, {"causal": True})
    call_backward(arrays, {"causal": True, "deterministic": deterministic})
    for n, a in arrays.items():
        assert bool(cupy.array_equal(bitwise(a), bitwise(snapshot[n]))), f"{n} was modified"


def test_arrays_on_different_devices_are_rejected():
    from types import SimpleNamespace

    def on(device):
        return SimpleNamespace(device=SimpleNamespace(id=device))

    assert _checks.same_device(q=on(0), k=on(0), v=on(0)) == 0
    with pytest.raises(ValueError, match="v is on GPU 1 but q is on GPU 0"):
        _checks.same_device(q=on(0), k=on(0), v=on(1))
