"""python -m cupy_flash: info, warmup, check, bench, source."""

import subprocess
import sys

import pytest
from helpers import HAS_GPU, requires_gpu

from cupy_flash import _cli, _compile, families


def test_info_runs_anywhere():
    """info prints the versions and the GPU (or why there is none) and exits 0, GPU or not."""
    result = subprocess.run([sys.executable, "-m", "cupy_flash", "info"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("cupy_flash ")
    assert "CuPy " in result.stdout and "NVRTC " in result.stdout and "kernel cache:" in result.stdout
    assert ("GPU 0:" in result.stdout) == HAS_GPU


def test_unknown_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        _cli.main(["compile-everything"])
    assert exit_info.value.code == 2
    assert _cli.main(["warmup", "--head-dims", "600"]) == 2


@pytest.mark.skipif(HAS_GPU, reason="the no-GPU answer (a GPU is present)")
@pytest.mark.parametrize("command", [["check"], ["warmup"], ["bench", "--modes", "fwd"]])
def test_gpu_commands_say_why_without_a_gpu(command, capsys):
    from cupy_flash._device import gpu_problem

    assert _cli.main(command) == 1
    err = capsys.readouterr().err
    assert "needs an NVIDIA GPU: " + gpu_problem() in err
    assert "insufficient" not in err   # CuPy's words for "no driver at all"


def test_warmup_specs_cover_what_calls_run():
    """The modules warmup compiles for dtypes x head dims x features x families: the tensor-core
    families for 16-bit types (for the given target), the CUDA-core ones for float32, the decode
    family (and its row kernels) with forward or decode, the preprocess module with backward."""
    h100 = families.DeviceInfo(90, 227 * 1024, 132)
    specs = _cli.warmup_specs(["bfloat16", "float32"], [64, 100], ["sink", "window"], ["forward", "backward"], h100)
    described = {s.describe() for s in specs}
    assert "forward_sm90 kernels (bfloat16, head_dim tile 64, sm90a tiles 128x64x128x2, window+sink)" in described
    assert "forward_sm90 kernels (bfloat16, head_dim tile 128, sm90a tiles 128x128x128x2, window+sink)" in described
    # Short backward calls take the tensor-core family, long ones the Hopper one (no sink in either).
    assert "backward_tc kernels (bfloat16, head_dim tile 128, sm90 tiles, window)" in described
    assert "backward_sm90 kernels (bfloat16, head_dim tile 128, sm90a tiles 128x128x64x2, window)" in described
    assert "forward kernels (float32, head_dim tile 64, window+sink)" in described
    assert "preprocess kernels (float32)" in described and "decode kernels (bfloat16)" in described
    assert len(specs) == len(set(specs))
    for spec in specs:   # every one is a module CuPy can be asked to build
        assert spec.name_expressions
    # Elsewhere (an A100), and with a bias on the H100, the forward is the mma.sync family's.
    a100 = _cli.warmup_specs(["bfloat16"], [64], [], ["forward"], families.DeviceInfo(80, 163 * 1024, 108))
    assert "forward_tc kernels (bfloat16, head_dim tile 64, sm80 tiles)" in {s.describe() for s in a100}
    # Plain calls at d = 64 take two tile shapes (three consumers, and 128 rows for short causal calls).
    plain = {s.describe() for s in _cli.warmup_specs(["bfloat16"], [64], [], ["forward"], h100)}
    assert {"forward_sm90 kernels (bfloat16, head_dim tile 64, sm90a tiles 192x64x128x2)",
            "forward_sm90 kernels (bfloat16, head_dim tile 64, sm90a tiles 128x64x128x2)"} <= plain, plain
    biased = _cli.warmup_specs(["bfloat16"], [64], ["bias"], ["forward"], h100)
    assert "forward_tc kernels (bfloat16, head_dim tile 64, sm90 tiles, bias)" in {s.describe() for s in biased}
    # Head dim 512: the Hopper forward (v blocks of 256) and the portable backward on the H100; an
    # A100 has the portable forward and no tensor-core backward for it.
    wide = {s.describe() for s in _cli.warmup_specs(["bfloat16"], [512], [], ["forward", "backward"], h100)}
    assert {"forward_sm90 kernels (bfloat16, head_dim tile 512, sm90a tiles 128x512x32x2x256)",
            "backward_tc kernels (bfloat16, head_dim tile 512, sm90 tiles)"} <= wide, wide
    a100_wide = {s.describe() for s in _cli.warmup_specs(["bfloat16"], [512], [], ["forward", "backward"],
                                                         families.DeviceInfo(80, 163 * 1024, 108))}
    assert "forward_tc kernels (bfloat16, head_dim tile 512, sm80 tiles)" in a100_wide
    assert not any(s.startswith("backward_tc") for s in a100_wide)


def test_index_records_compiled_modules(tmp_path, monkeypatch):
    """The index beside CuPy's cache lists a module once compiled, keyed to its source digest."""
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path))
    spec = families.decode.module_spec("float16")
    _compile.record_in_index(spec, 90)
    index = _compile.read_index()
    assert list(index) == [f"{spec.describe()} sm_90"]
    assert index[f"{spec.describe()} sm_90"]["digest"] == _compile.source_digest("decode")


@requires_gpu
def test_warmup_check_and_info_on_the_gpu(tmp_path, monkeypatch, capsys):
    """warmup compiles and info then lists the modules; check passes on this GPU (exit 0)."""
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path))
    assert _cli.main(["warmup", "--dtypes", "bf16", "--head-dims", "64", "--families", "decode"]) == 0
    assert _cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "decode kernels (bfloat16, head_dim tile 64) sm_" in out
    assert _cli.main(["check"]) == 0, capsys.readouterr().out


def test_source_prints_a_family_and_the_interface(capsys):
    assert _cli.main(["source", "forward_sm90"]) == 0
    assert capsys.readouterr().out == _compile.family_source("forward_sm90")
    assert _cli.main(["source", "--interface"]) == 0
    assert capsys.readouterr().out == _compile.interface_header()
    assert _cli.main(["source"]) == 2 and _cli.main(["source", "decode", "--interface"]) == 2


def test_bench_is_the_attention_benchmark_and_its_help_needs_no_gpu(capsys):
    """python -m cupy_flash bench is python -m bench (cupy_flash/benchmark.py), flags and all."""
    with pytest.raises(SystemExit) as exit_info:
        _cli.main(["bench", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "python -m cupy_flash bench" in out
    assert all(flag in out for flag in ("--dtypes", "--head-dims", "--seqlens", "--causal", "--modes", "--rounds", "--out"))


@requires_gpu
def test_bench_runs_one_shape(tmp_path, capsys):
    assert _cli.main(["bench", "--dtypes", "bf16", "--head-dims", "64", "--seqlens", "512", "--causal", "0",
                      "--modes", "fwd", "--out", str(tmp_path)]) == 0
    assert "ours" in capsys.readouterr().out and list(tmp_path.glob("attention-*.json"))
