"""CPU: what a machine without a usable GPU is told (cupy_flash/_device.py), for each reason."""

import types

import pytest

from cupy_flash import _device


def fake_cupy(driver: int, runtime: int, count=None, error=None):
    """A stand-in for the cupy module: its runtime's versions, and getDeviceCount's answer."""
    def device_count():
        if error is not None:
            raise error
        return count

    api = types.SimpleNamespace(getDeviceCount=device_count, driverGetVersion=lambda: driver,
                                runtimeGetVersion=lambda: runtime)
    return types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=api), __version__="14.2.0")


INSUFFICIENT = RuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version")


def test_no_driver_is_said_as_such():
    message = _device.problem_with(fake_cupy(0, 12090, error=INSUFFICIENT))
    assert message.startswith("no NVIDIA driver found") and "insufficient" not in message


@pytest.mark.parametrize("driver, runtime, advice", [
    (12020, 13000, 'pip install ".[cuda12]", whose CuPy is built for CUDA 12'),
    (11080, 12090, "update the driver (cupy_flash needs CUDA 12 or newer)"),
])
def test_an_old_driver_gets_both_versions_and_the_extra_that_fits(driver, runtime, advice):
    message = _device.problem_with(fake_cupy(driver, runtime, error=INSUFFICIENT))
    assert f"supports CUDA {driver // 1000}." in message and f"CUDA {runtime // 1000}." in message
    assert advice in message


def test_a_driver_without_a_gpu():
    assert _device.problem_with(fake_cupy(12090, 12090, count=0)) == "no NVIDIA GPU found: the driver (CUDA 12.9) sees none"
    assert _device.problem_with(fake_cupy(12090, 12090, count=2)) is None


def test_require_gpu_exits_with_one_line(monkeypatch):
    monkeypatch.setattr(_device, "gpu_problem", lambda: "no NVIDIA driver found (...)")
    with pytest.raises(SystemExit, match=r"^quickstart needs an NVIDIA GPU: no NVIDIA driver found \(...\)$"):
        _device.require_gpu("quickstart")
