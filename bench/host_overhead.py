"""Host time per call: the direct calls, the PyTorch and JAX adapters, and cuDNN's through SDPA.

    python -m bench.host_overhead                  # the table (needs a GPU; PyTorch and JAX if present)
    python -m bench.host_overhead --baseline DIR   # also DIR's cupy_flash (another checkout), same process
    python -m bench.host_overhead --profile        # and a cProfile of each of our host paths

bench/attention.py times each call alone (events around one call), so a call's Python time before
its launch counts as GPU time whenever the GPU waits for it. This measures the host side alone:
microseconds of Python per call, warm (plans made, the pool's blocks in place), no synchronisation,
on a problem small enough that the GPU keeps up (the median of 7 runs of 500 calls, the calls of a
group interleaved run by run). Rows:
- ``flash_forward``, ``flash_backward``, ``flash_decode`` on CuPy arrays, beside the same calls with
  their launches one by one rather than replayed as a CUDA graph (_launch.Packed);
- on Hopper, the FP8 ``flash_forward`` and ``flash_backward`` with host descales, beside bf16's;
- ``torch_adapter.flash_attn_func``: a forward without grad, a forward that records its autograd
  node, and forward + ``backward()``, beside SDPA's cuDNN backend doing the same and a trivial
  ``torch.autograd.Function`` (what any autograd node costs);
- ``jax_adapter.flash_attention`` under ``jax.jit`` (forward, and forward + backward through
  ``jax.vjp``) beside ``jax.nn.dot_product_attention`` (cuDNN), a jitted custom call that does
  nothing (what the adapter's handler costs before any launch; and buffer_callback's, where jaxlib
  has it), and ``jit(q + 1)`` (XLA's own floor for a jitted call).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time

import cupy

import cupy_flash
from bench.attention import DTYPES

SHAPE = (1, 128, 2, 64)   # batch, seqlen, heads, head_dim: a GPU time of a few microseconds a kernel


def host_us(calls: dict, per_run=500, runs=7) -> dict:
    """{name: median over ``runs`` of the host microseconds per call} of the functions in ``calls``
    (warm, no sync inside a run), their runs interleaved (A B C, then C B A, ...) so that a drift
    of the host's speed falls on all alike: timed one after the other, the same call read 14 and
    22 us on two machines, and 21 against 19 us beside a baseline it beat by a third elsewhere."""
    for fn in calls.values():
        for _ in range(20):
            fn()
    cupy.cuda.Device().synchronize()
    samples = {name: [] for name in calls}
    for run in range(runs):
        for name in (list(calls) if run % 2 == 0 else list(calls)[::-1]):
            fn = calls[name]
            started = time.perf_counter()
            for _ in range(per_run):
                fn()
            samples[name].append(1e6 * (time.perf_counter() - started) / per_run)
            cupy.cuda.Device().synchronize()
    return {name: statistics.median(values) for name, values in samples.items()}


def random(shape, dtype, seed):
    return cupy.random.default_rng(seed).standard_normal(shape, dtype=cupy.float32).astype(dtype)


def direct_calls(module, dtype, seed: int, label: str) -> dict:
    """{name + label: the call} of flash_forward, flash_backward and flash_decode from ``module``
    on arrays of their own (drawn from ``seed``)."""
    q, k, v, do = (random(SHAPE, dtype, seed + s) for s in range(4))
    cache = random((1, 4096, 2, 64), dtype, seed + 5), random((1, 4096, 2, 64), dtype, seed + 6)
    query = random((1, 1, 16, 64), dtype, seed + 7)
    lengths = cupy.full((1,), 4000, dtype=cupy.int32)
    o, lse = module.flash_forward(q, k, v, causal=True)
    return {f"flash_forward{label}": lambda: module.flash_forward(q, k, v, causal=True),
            f"flash_backward{label}": lambda: module.flash_backward(do, q, k, v, o, lse, causal=True),
            f"flash_decode{label} (GQA 16/2, 4k cache)": lambda: module.flash_decode(query, *cache, cache_seqlens=lengths)}


def direct_rows(dtype, baseline=None):
    """The direct calls; beside them the same calls on arrays of their own whose launches go one by
    one (no graph is captured during them: _launch.Packed), and ``baseline``'s."""
    from cupy_flash import _launch

    calls = direct_calls(cupy_flash, dtype, 0, "")
    graphs_on, graphs_off = _launch._graphs_variable, lambda: "0"

    def one_by_one(call):
        def timed():
            _launch._graphs_variable = graphs_off   # what CUPY_FLASH_GRAPHS=0 does, for this call alone
            try:
                call()
            finally:
                _launch._graphs_variable = graphs_on
        return timed

    calls.update({name: one_by_one(call) for name, call in direct_calls(cupy_flash, dtype, 10, " (launches one by one)").items()})
    if baseline is not None:
        calls.update(direct_calls(baseline, dtype, 0, " (baseline)"))
    return list(host_us(calls).items())


def fp8_rows():
    """flash_forward and flash_backward on e4m3 q, k, v with host descales (Hopper only), timed
    beside the bf16 direct calls of the same shape."""
    if cupy.cuda.Device().compute_capability != "90":
        return []
    quantised = [cupy_flash.quantize_fp8(random(SHAPE, cupy.float32, s)) for s in range(3)]
    q8, k8, v8 = (x8 for x8, _ in quantised)
    descales = {name: cupy.asnumpy(descale) for name, (_, descale) in zip(("q_descale", "k_descale", "v_descale"), quantised)}
    o, lse = cupy_flash.flash_forward(q8, k8, v8, causal=True, **descales)
    do = random(SHAPE, DTYPES["bf16"], 9)
    bf16 = [random(SHAPE, DTYPES["bf16"], s) for s in range(3)]
    o16, lse16 = cupy_flash.flash_forward(*bf16, causal=True)
    calls = {"flash_forward fp8 (host descales)": lambda: cupy_flash.flash_forward(q8, k8, v8, causal=True, **descales),
             "flash_forward bf16 (beside it)": lambda: cupy_flash.flash_forward(*bf16, causal=True),
             "flash_backward fp8 (host descales)": lambda: cupy_flash.flash_backward(do, q8, k8, v8, o, lse, causal=True,
                                                                                      **descales),
             "flash_backward bf16 (beside it)": lambda: cupy_flash.flash_backward(do, *bf16, o16, lse16, causal=True)}
    return list(host_us(calls).items())


def torch_rows(dtype_name):
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        from cupy_flash.torch_adapter import flash_attn_func
    except Exception as error:   # noqa: BLE001 - timing ours alone
        print(f"PyTorch rows skipped ({type(error).__name__}: {error})", file=sys.stderr)
        return []
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    q, k, v = (torch.randn(SHAPE, device="cuda", dtype=dtype) for _ in range(3))
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    do = torch.randn(SHAPE, device="cuda", dtype=dtype)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    sq, sk, sv, sdo = (x.transpose(1, 2) for x in (q, k, v, do))
    sqg, skg, svg = (x.detach().clone().requires_grad_() for x in (sq, sk, sv))

    # Inputs that do not require grad record no autograd node: the call alone (a torch.no_grad()
    # block around each call would add its own ~1-2 us to both rows).
    def ours_no_grad():
        flash_attn_func(q, k, v, causal=True)

    def ours_both():
        flash_attn_func(qg, kg, vg, causal=True).backward(do)

    def cudnn_no_grad():
        sdpa(sq, sk, sv, is_causal=True)

    def cudnn_both():
        sdpa(sqg, skg, svg, is_causal=True).backward(sdo)

    class Identity(torch.autograd.Function):   # what any autograd node costs
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return grad

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return list(host_us({
            "torch adapter: forward, no grad": ours_no_grad,
            "SDPA cuDNN: forward, no grad": cudnn_no_grad,
            "torch adapter: forward, autograd node": lambda: flash_attn_func(qg, kg, vg, causal=True),
            "SDPA cuDNN: forward, autograd node": lambda: sdpa(sqg, skg, svg, is_causal=True),
            "torch: a trivial autograd.Function": lambda: Identity.apply(qg),
            "torch: a trivial autograd.Function, forward + backward()": lambda: Identity.apply(qg).backward(do),
            "torch adapter: forward + backward()": ours_both,
            "SDPA cuDNN: forward + backward()": cudnn_both,
        }).items())


def jax_rows(dtype_name, baseline=None):
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.3")
    try:
        import jax
        import jax.numpy as jnp

        from cupy_flash import _xla_ffi
        from cupy_flash.jax_adapter import flash_attention
    except Exception as error:   # noqa: BLE001 - timing ours alone
        print(f"JAX rows skipped ({type(error).__name__}: {error})", file=sys.stderr)
        return []
    dtype = {"bf16": jnp.bfloat16, "fp16": jnp.float16}[dtype_name]
    q, k, v, do = (jax.random.normal(jax.random.PRNGKey(i), SHAPE, dtype=dtype) for i in range(4))

    def attention_fns(attention):
        forward = jax.jit(lambda q, k, v: attention(q, k, v))

        @jax.jit
        def forward_backward(q, k, v, do):
            o, vjp = jax.vjp(attention, q, k, v)
            return o, vjp(do)
        return forward, forward_backward

    ours = attention_fns(lambda q, k, v: flash_attention(q, k, v, causal=True))
    ours[0](q, k, v)   # its FFI target registered before a baseline's
    cudnn = attention_fns(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"))
    results = (jax.ShapeDtypeStruct(SHAPE, dtype), jax.ShapeDtypeStruct((SHAPE[0], SHAPE[2], SHAPE[1]), jnp.float32))
    nothing = _xla_ffi.python_call(lambda call: None, results)
    empty = jax.jit(lambda q, k, v: nothing(q, k, v)[0])   # the adapter's outputs (o, lse), o returned
    plus_one = jax.jit(lambda q: q + 1)
    calls = {"jax adapter: jit(flash_attention)": lambda: ours[0](q, k, v),
             "jax: jit of an empty custom call (_xla_ffi)": lambda: empty(q, k, v),
             "jax: jit(q + 1)": lambda: plus_one(q),
             "jax cuDNN: jit(dot_product_attention)": lambda: cudnn[0](q, k, v),
             "jax adapter: jit(vjp) forward + backward": lambda: ours[1](q, k, v, do),
             "jax cuDNN: jit(vjp) forward + backward": lambda: cudnn[1](q, k, v, do)}
    try:
        from jax.experimental.buffer_callback import buffer_callback

        nothing_bc = buffer_callback(lambda context, out, q, k, v: None, results)
        empty_bc = jax.jit(lambda q, k, v: nothing_bc(q, k, v)[0])
        calls["jax: jit of an empty buffer_callback"] = lambda: empty_bc(q, k, v)
    except ImportError:
        pass
    if baseline is not None:
        try:
            import importlib

            old = importlib.import_module(baseline.__name__ + ".jax_adapter").flash_attention
            old_fns = attention_fns(lambda q, k, v: old(q, k, v, causal=True))
            old_fns[0](q, k, v)   # a tree whose FFI target has this one's name fails here, not in the timing
            calls["jax adapter (baseline): jit(flash_attention)"] = lambda: old_fns[0](q, k, v)
            calls["jax adapter (baseline): jit(vjp) forward + backward"] = lambda: old_fns[1](q, k, v, do)
        except Exception as error:   # noqa: BLE001 - a baseline without this adapter
            print(f"baseline JAX rows skipped ({type(error).__name__}: {error})", file=sys.stderr)
    for name in [n for n in calls if "cuDNN" in n]:
        try:
            calls[name]()
        except Exception as error:   # noqa: BLE001 - a peer that does not run here
            print(f"{name} row skipped ({type(error).__name__}: {str(error)[:100]})", file=sys.stderr)
            del calls[name]
    return list(host_us(calls).items())


def profile(dtype):
    for label, call in direct_calls(cupy_flash, dtype, 0, "").items():
        for _ in range(5):   # warm: plans made, graphs captured
            call()
        recorder = cProfile.Profile()
        recorder.enable()
        for _ in range(300):
            call()
        recorder.disable()
        print(f"\nprofile | {label}, 300 calls")
        pstats.Stats(recorder).sort_stats("tottime").print_stats(12)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.host_overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", help="a checkout whose cupy_flash is timed beside this one (bench.variants)")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    from cupy_flash._device import require_gpu

    require_gpu("python -m bench.host_overhead")
    dtype = DTYPES[args.dtype]
    baseline = None
    if args.baseline:
        from bench.variants import load_baseline

        baseline = load_baseline(args.baseline)
    rows = direct_rows(dtype, baseline) + fp8_rows() + torch_rows(args.dtype) + jax_rows(args.dtype, baseline)
    device = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    print(f"\nHost microseconds per call ({args.dtype}, q {SHAPE}, causal; median of 7 interleaved runs of 500 calls; "
          f"{device})\n")
    print("| call | us |\n|---|---|")
    for name, us in rows:
        print(f"| {name} | {us:.1f} |")
    if args.profile:
        profile(dtype)
    return rows


if __name__ == "__main__":
    main()
