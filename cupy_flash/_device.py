"""Whether this machine can run the kernels, and if not, a message that says what is true.

CuPy reports a machine with no NVIDIA driver at all as "cudaErrorInsufficientDriver: CUDA driver
version is insufficient for CUDA runtime version", which tells a user to upgrade a driver they do
not have. ``gpu_problem`` tells the three cases apart: no driver, a driver older than this CuPy's
CUDA (both versions, and the extra that fits it), a driver that sees no GPU.
"""

from __future__ import annotations

import functools
import glob


def install_hint(extra: str) -> str:
    """The install command for an extra, worded as the README's (run in the checkout)."""
    return f'pip install ".[{extra}]"'


def _version(value: int) -> str:
    return f"{value // 1000}.{value % 1000 // 10}"


@functools.lru_cache(maxsize=None)
def gpu_problem() -> str | None:
    """None when CuPy sees a CUDA GPU; otherwise one line on why not (no driver, an old driver, no
    GPU, no CuPy). Cached: a process's answer does not change."""
    try:
        import cupy
    except ImportError as error:
        return (f"CuPy is not installed ({error}): {install_hint('cuda12')} (NVIDIA driver for CUDA 12) or "
                f"{install_hint('cuda13')} (CUDA 13)")
    return problem_with(cupy)


def problem_with(cupy) -> str | None:
    """gpu_problem's answer for this ``cupy`` module (tests hand in stand-ins)."""
    runtime = cupy.cuda.runtime
    try:
        count = runtime.getDeviceCount()
    except Exception as error:
        return _explain(cupy, error)
    if count < 1:
        return f"no NVIDIA GPU found: the driver (CUDA {_version(runtime.driverGetVersion())}) sees none"
    return None


def _explain(cupy, error) -> str:
    runtime = cupy.cuda.runtime
    try:
        driver = runtime.driverGetVersion()   # 0 where no driver library loads
    except Exception:
        driver = 0
    built_for = runtime.runtimeGetVersion()
    if driver == 0:
        devices = "no /dev/nvidia* device files" if not glob.glob("/dev/nvidia*") else "but /dev/nvidia* exist"
        return (f"no NVIDIA driver found (its library libcuda does not load; {devices}): cupy_flash runs on "
                "NVIDIA GPUs only")
    if driver // 1000 < built_for // 1000:
        fits = "cuda12" if driver // 1000 == 12 else None
        advice = (f"update the driver, or {install_hint(fits)}, whose CuPy is built for CUDA {driver // 1000}"
                  if fits else "update the driver (cupy_flash needs CUDA 12 or newer)")
        return (f"the NVIDIA driver supports CUDA {_version(driver)}, older than the CUDA {_version(built_for)} this "
                f"CuPy ({cupy.__version__}) is built for: {advice}")
    return f"no usable NVIDIA GPU (driver for CUDA {_version(driver)}): {type(error).__name__}: {str(error)[:160]}"


def require_gpu(what: str) -> None:
    """Exit with one line (status 1) when no GPU is usable: the examples' and commands' first check.
    A ``-h`` / ``--help`` on the command line passes, so that the help is printed without a GPU."""
    import sys

    if {"-h", "--help"} & set(sys.argv[1:]):
        return
    problem = gpu_problem()
    if problem is not None:
        raise SystemExit(f"{what} needs an NVIDIA GPU: {problem}")
