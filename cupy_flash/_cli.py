"""Command line: python -m cupy_flash <command>

    info     versions (cupy_flash, CuPy, CUDA runtime, driver, NVRTC), the GPUs, and which kernel
             modules are compiled and cached on this machine for this source
    warmup   compile chosen kernel modules ahead of time (a progress bar), so a first training or
             generation step does not stall on NVRTC; CuPy keeps them in its disk cache
    check    a short self-test on this GPU: forward, backward and decode against the dense
             reference (the 2x error rule); exit status 0 when all pass, 1 otherwise
    bench    the attention benchmark: forward and backward TFLOP/s against PyTorch SDPA's
             FlashAttention-2 and cuDNN backends on the same data (ours alone without PyTorch),
             a table, JSON and a plot (python -m cupy_flash bench --help)
    launch   run a script as one process per GPU with torchrun's environment (RANK, WORLD_SIZE,
             LOCAL_RANK, MASTER_ADDR, MASTER_PORT), for distributed.NcclRing.from_environment:
             python -m cupy_flash launch -n 2 examples/ring_attention.py
    source   the CUDA text one kernel family compiles from (its .cu with the headers expanded), or
             with --interface the header Python writes (flash_interface.cuh), to compile a
             kernels_cu file on its own with nvcc -I
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

import numpy

from . import __version__, _compile, _device, _features, _traits, families

DTYPE_NAMES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
               "fp32": "float32", "float32": "float32"}
FEATURE_BY_NAME = {name: flag for flag, name in _features.FEATURE_NAMES.items()}


def _gpu_or_reason():
    """(True, '') with a usable GPU, else (False, why): no driver, an old one, no GPU (_device)."""
    problem = _device.gpu_problem()
    return problem is None, problem or ""


# ---------------------------------------------------------------------------------------------
# info

def command_info(args) -> int:
    print(f"cupy_flash {__version__}   Python {platform.python_version()}   NumPy {numpy.__version__}")
    try:
        import cupy
        from cupy_backends.cuda.libs import nvrtc
    except ImportError as error:
        print(f"CuPy: not importable ({error}); {_device.install_hint('cuda12')} or {_device.install_hint('cuda13')}")
        return 1
    runtime = cupy.cuda.runtime
    versions = [f"CuPy {cupy.__version__}", f"CUDA runtime {_version(runtime.runtimeGetVersion())}",
                "NVRTC {}.{}".format(*nvrtc.getVersion())]
    try:
        driver = runtime.driverGetVersion()
    except Exception:
        driver = 0
    versions.append(f"driver (CUDA) {_version(driver)}" if driver else "driver: none")
    print("   ".join(versions))
    ok, reason = _gpu_or_reason()
    if ok:
        for device in range(runtime.getDeviceCount()):
            props = runtime.getDeviceProperties(device)
            print(f"GPU {device}: {props['name'].decode()}, sm_{props['major']}{props['minor']}, "
                  f"{props['multiProcessorCount']} SMs, {props['totalGlobalMem'] / 2**30:.0f} GiB")
            with cupy.cuda.Device(device):
                for line in families.describe_forward(families.current_device()):
                    print(f"  forward, {line}")
                print(f"  backward, {families.describe_backward(families.current_device())}")
    else:
        print(f"GPU: none: {reason}")
    index = _compile.read_index()
    digests = {family: _safe_digest(family) for family in {entry.get("family") for entry in index.values()}}
    current = {key: entry for key, entry in index.items() if entry.get("digest") == digests[entry.get("family")]}
    print(f"kernel cache: {_compile.cache_dir()}  ({len(current)} cupy_flash modules compiled for this source"
          f"{f', {len(index) - len(current)} for older sources' if len(index) > len(current) else ''})")
    for key in sorted(current):
        print(f"  {key}  ({current[key]['when']})")
    if not current:
        print("  none yet: modules compile on first use" + (" (or run `python -m cupy_flash warmup`)" if ok
                                                             else ", on a machine with an NVIDIA GPU"))
    return 0


def _version(value: int) -> str:
    return f"{value // 1000}.{value % 1000 // 10}"


def _safe_digest(family):
    try:
        return _compile.source_digest(family)
    except Exception:
        return None


# ---------------------------------------------------------------------------------------------
# warmup

def warmup_specs(dtypes, head_dims, features, kinds, device) -> list:
    """The ModuleSpecs that calls with these dtypes, head dims and feature names run on ``device``
    (a families.DeviceInfo), short and long, as the dispatch rule picks their families; ``kinds``:
    "forward", "backward", "decode"."""
    import types

    from ._checks import AttentionShape

    flags = 0
    for name in features:
        flags |= FEATURE_BY_NAME[name]
    variant = types.SimpleNamespace(flags=flags, backward_flags=flags & ~_features.FORWARD_ONLY_FEATURES, causal=False)
    specs = []
    for dtype in dtypes:
        if "backward" in kinds:
            specs.append(families.rows.module_spec(dtype))
        if "decode" in kinds or "forward" in kinds:
            specs.append(families.decode.module_spec(dtype))   # combine (split path, merges)
        for head_dim in head_dims:
            for seqlen in (128, 16384):   # each family a short or a long call may take
                shape = AttentionShape(1, seqlen, seqlen, 1, head_dim, dtype)
                if "forward" in kinds:
                    specs += families.forward_family(device, shape, variant).warmup_specs(device, shape, flags)
                if "backward" in kinds:
                    specs += families.backward_family(device, shape, variant).warmup_specs(device, shape, flags)
            if ("decode" in kinds or "forward" in kinds) and dtype in _compile.TENSOR_CORE_DTYPES:
                specs.append(families.decode.module_spec(dtype, _traits.head_dim_tile(head_dim), flags))
    return list(dict.fromkeys(specs))


def _progress(done, total, label, started, stream=sys.stderr):
    width = 28
    filled = int(width * done / total) if total else width
    stream.write(f"\r[{'#' * filled}{' ' * (width - filled)}] {done}/{total} {time.time() - started:5.0f}s  {label[:70]:<70}")
    stream.flush()


def command_warmup(args) -> int:
    ok, reason = _gpu_or_reason()
    if not ok:
        print(f"warmup needs an NVIDIA GPU: {reason} (CuPy loads each module it compiles)", file=sys.stderr)
        return 1
    specs = warmup_specs([DTYPE_NAMES[d] for d in args.dtypes], args.head_dims, args.features, args.families,
                         families.current_device())
    started = time.time()
    for i, spec in enumerate(specs):
        _progress(i, len(specs), spec.describe(), started)
        for name in spec.kernels:
            _compile.get_kernel(spec, name)
        _compile.record_in_index(spec)   # also when this process had already loaded it
    _progress(len(specs), len(specs), "done", started)
    print(f"\n{len(specs)} modules ready in {time.time() - started:.0f} s (cached in {_compile.cache_dir()})",
          file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------
# check

CHECK_CASES = [   # (dtype, batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, causal, features)
    ("bfloat16", 2, 257, 257, 4, 2, 64, True, {}),
    ("float16", 1, 128, 515, 2, 2, 128, False, {"window_size": (100, 30)}),
    ("bfloat16", 2, 96, 96, 4, 1, 96, True, {"softcap": 20.0, "sink": "per-head"}),
    ("float16", 3, 33, 200, 2, 2, 256, False, {"alibi": "per-head"}),
    ("float32", 1, 70, 70, 2, 2, 40, True, {}),
]


def _error_rule(ours, exact, low) -> tuple[bool, float]:
    """FlashAttention's rule: max error at most twice the dense low-precision reference's, plus a
    floor; returns (passed, error / bound)."""
    from .reference import _to_float, _xp

    xp = _xp(exact)
    ours, lows = _to_float(ours, xp, xp.float64), low if isinstance(low, tuple) else (low,)
    err = float(xp.abs(ours - exact).max())
    low_err = max(float(xp.abs(_to_float(x, xp, xp.float64) - exact).max()) for x in lows)
    bound = 2 * low_err + 1e-5 * max(1.0, float(xp.abs(exact).max()))
    return bool(err <= bound) and not bool(xp.isnan(ours).any()), err / bound


def command_check(args) -> int:
    ok, reason = _gpu_or_reason()
    if not ok:
        print(f"check needs an NVIDIA GPU: {reason}", file=sys.stderr)
        return 1
    import cupy

    from . import flash_backward, flash_decode, flash_forward
    from .reference import (
        attention_reference,
        attention_reference_backward,
        decode_reference,
        low_precision_backward_forms,
        low_precision_forward_forms,
    )

    rng = numpy.random.default_rng(args.seed)
    failures = 0
    started = time.time()
    print(f"{'case':<58} {'quantity':<6} {'err/bound':>9}")

    def report(case, name, result):
        nonlocal failures
        passed, used = result
        failures += not passed
        print(f"{case:<58} {name:<6} {used:9.3f}{'' if passed else '   FAIL'}", flush=True)

    for dtype, batch, nq, nk, heads, heads_kv, d, causal, features in CHECK_CASES:
        dt = numpy.dtype(_dtype(dtype))
        q, k, v, do = (_random(rng, shape, dt) for shape in ((batch, nq, heads, d), (batch, nk, heads_kv, d),
                                                            (batch, nk, heads_kv, d), (batch, nq, heads, d)))
        options = dict(causal=causal)
        for name, value in features.items():
            if name == "sink":
                options["sink"] = cupy.asarray(numpy.linspace(-1, 1, heads), cupy.float32)
            elif name == "alibi":
                options["alibi_slopes"] = cupy.asarray(2.0 ** -numpy.arange(1, heads + 1), cupy.float32)
            else:
                options[name] = value
        case = f"{dtype} b={batch} nq={nq} nk={nk} h={heads}/{heads_kv} d={d} causal={causal} {list(features)}"
        o, lse = flash_forward(q, k, v, **options)
        exact = attention_reference(q, k, v, **options)
        low = low_precision_forward_forms(q, k, v, **options)
        report(case, "o", _error_rule(o, exact[0], low[0]))
        grads = flash_backward(do, q, k, v, o, lse, **options)
        exact = attention_reference_backward(do, q, k, v, **options)
        lows = low_precision_backward_forms(do, q, k, v, **options)
        for name, ours, e, lo in zip(("dq", "dk", "dv"), grads, exact, lows):
            report(case, name, _error_rule(ours, e, lo))
    # Decoding: a paged cache, GQA, an append.
    batch, heads, heads_kv, d, page = 2, 8, 2, 128, 64
    lengths = numpy.array([700, 1500], numpy.int32)
    k_cache, v_cache = (_random(rng, (batch * 2048 // page, page, heads_kv, d), numpy.dtype(_dtype("bfloat16")))
                        for _ in range(2))
    table = cupy.asarray(rng.permutation(batch * 2048 // page).astype(numpy.int32).reshape(batch, -1))
    q = _random(rng, (batch, 1, heads, d), k_cache.dtype)
    k_new, v_new = (_random(rng, (batch, 1, heads_kv, d), k_cache.dtype) for _ in range(2))
    cache = dict(cache_seqlens=cupy.asarray(lengths), k_new=k_new, v_new=v_new, block_table=table)
    exact = decode_reference(q, k_cache, v_cache, **cache)
    low = decode_reference(q, k_cache, v_cache, upcast=False, **cache)
    o, _ = flash_decode(q, k_cache, v_cache, **cache)
    report("bfloat16 decode: paged (64), GQA 4:1, lengths 700/1500 + 1", "o", _error_rule(o, exact[0], low[0]))
    print(f"{'all passed' if not failures else f'{failures} FAILED'} in {time.time() - started:.0f} s")
    return 1 if failures else 0


def _dtype(name):
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return name


def _random(rng, shape, dtype):
    import cupy

    return cupy.asarray(rng.standard_normal(shape, dtype=numpy.float32).astype(dtype))


# ---------------------------------------------------------------------------------------------
# source

def command_source(args) -> int:
    if args.interface == (args.family is not None):
        print("source: name a family or give --interface", file=sys.stderr)
        return 2
    sys.stdout.write(_compile.interface_header() if args.interface else _compile.family_source(args.family))
    return 0


# ---------------------------------------------------------------------------------------------

def command_launch(args) -> int:
    from . import _rendezvous

    if not args.program:
        print("launch: a script (or -m module) to run is missing", file=sys.stderr)
        return 2
    processes = args.nproc
    if processes is None:
        try:
            import cupy

            processes = cupy.cuda.runtime.getDeviceCount()
        except Exception:   # noqa: BLE001 - no GPU or no CuPy: one process, which says why itself
            processes = 1
    if processes < 1:
        print(f"launch: --nproc {processes}: expected at least 1", file=sys.stderr)
        return 2
    return _rendezvous.launch(args.program, processes, args.port)


# ---------------------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m cupy_flash", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = top.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="versions, GPUs, compiled kernel modules")
    warmup = commands.add_parser("warmup", help="compile kernel modules ahead of time")
    warmup.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"], choices=sorted(DTYPE_NAMES))
    warmup.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    warmup.add_argument("--features", nargs="*", default=[], choices=sorted(FEATURE_BY_NAME),
                        help="variant flags the calls use (window, softcap, alibi, sink, bias, varlen)")
    warmup.add_argument("--families", nargs="+", default=["forward", "backward"],
                        choices=["forward", "backward", "decode"])
    check = commands.add_parser("check", help="self-test against the reference on this GPU (exit 0/1)")
    check.add_argument("--seed", type=int, default=0)
    # bench: its own parser (cupy_flash/benchmark.py), which main hands the rest of the line to
    commands.add_parser("bench", help="TFLOP/s against PyTorch SDPA's flash and cuDNN (bench --help)", add_help=False)
    launch = commands.add_parser("launch", help="one process per GPU with torchrun's environment")
    launch.add_argument("-n", "--nproc", type=int, default=None, help="processes (default: the GPUs visible)")
    launch.add_argument("--port", type=int, default=None, help="MASTER_PORT (default: a free one)")
    launch.add_argument("program", nargs=argparse.REMAINDER, help="script.py [args] or -m module [args]")
    source = commands.add_parser("source", help="a kernel family's CUDA text, or the interface header")
    source.add_argument("family", nargs="?", choices=_compile.FAMILIES)
    source.add_argument("--interface", action="store_true", help=f"print {_compile.INTERFACE_HEADER}")
    return top


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:   # the benchmark parses its own flags, then asks for a GPU
        from .benchmark import main as bench

        try:
            bench(argv[1:], prog="python -m cupy_flash bench")
        except SystemExit as stop:
            if not isinstance(stop.code, str):   # argparse's exit (2, or 0 after --help)
                raise
            print(stop.code, file=sys.stderr)    # require_gpu's one line
            return 1
        return 0
    args = parser().parse_args(argv)
    for head_dim in getattr(args, "head_dims", []):
        if not 1 <= head_dim <= _traits.MAX_HEAD_DIM:
            print(f"head dim {head_dim}: expected 1 to {_traits.MAX_HEAD_DIM}", file=sys.stderr)
            return 2
    return {"info": command_info, "warmup": command_warmup, "check": command_check, "launch": command_launch,
            "source": command_source}[args.command](args)
