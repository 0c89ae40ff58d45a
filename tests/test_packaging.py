"""The wheel carries every kernel source and the type marker; the package is typed."""

import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_wheel_contains_every_kernel_source(tmp_path):
    pytest.importorskip("setuptools", minversion="77")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                           "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    wheels = list(tmp_path.glob("cupy_flash-*.whl"))
    assert len(wheels) == 1
    names = set(zipfile.ZipFile(wheels[0]).namelist())
    sources = sorted(p.name for p in (ROOT / "kernels_cu").iterdir() if p.suffix in (".cu", ".cuh"))
    print(f"{wheels[0].name}: {len(names)} files; kernel sources: {', '.join(sources)}")
    assert sources and all(f"cupy_flash/kernels_cu/{name}" in names for name in sources)
    modules = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "cupy_flash").rglob("*.py"))
    assert any(name.startswith("cupy_flash/families/") for name in modules)
    assert [name for name in modules if name not in names] == []
    assert "cupy_flash/py.typed" in names
    licenses = [name for name in names if name.endswith(".dist-info/licenses/LICENSE")]
    assert licenses, "the wheel carries no LICENSE"
    metadata = zipfile.ZipFile(wheels[0]).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: BSD-3-Clause" in metadata
    assert not any(name.startswith(("tests/", "bench/", "examples/")) for name in names)
    assert not [name for name in names if name.startswith("cupy_flash/kernels_cu/") and not name.endswith((".cu", ".cuh"))]


def test_package_is_typed():
    assert (ROOT / "cupy_flash" / "py.typed").exists()
