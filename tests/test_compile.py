"""CPU: every kernel instantiation compiles with NVRTC for sm_80 and sm_90 (the Hopper family for
sm_90a), without a GPU, with no register spills, no stack frame (an indexed register array gone to
local memory) and none of ptxas's silent slow-downs (setmaxnreg ignored, wgmma serialised).

All modules are compiled once per run, in parallel processes (CI has 2 cores); each (module, arch)
pair is then its own test case."""

import re
import time

import pytest

from cupy_flash import _compile, _tma, _traits, families
from cupy_flash.families import cuda_core, sm90, tensor_core

ARCHS = _compile.ALL_ARCHS

# Known and measured: the tensor-core backward for packed (varlen) batches holds each sequence's
# lengths and row offsets, which are loaded (not kernel parameters ptxas can rematerialise), in a
# kernel already at 255 registers; ptxas spills 4-24 bytes in some of its instantiations (76 in one
# sm_8x d=128 combination). Re-reading them at each use, 32-bit offsets and smaller score passes
# each moved the spills between instantiations without removing them (docs/decisions.md). Every
# other instantiation must not spill at all.
VARLEN_BACKWARD_SPILL_LIMIT = 128
# Known and measured: the FP8 forward at d = 256 holds O (128 registers), S of a 128-key block (64)
# and P's e4m3 operand (16) at 240 registers a consumer, the most the split allows; its masked
# instantiations (causal, window) spill 4-12 bytes. Its 128-key blocks are V^T's 128-byte rows
# (docs/fp8.md). Every other Hopper instantiation must not spill.
FP8_D256_SPILL_LIMIT = 16


def spill_limit(spec) -> int:
    from cupy_flash._dtypes import FP8_DTYPE
    from cupy_flash._features import FEATURE_VARLEN

    if spec.family == "forward_sm90" and spec.dtype == FP8_DTYPE and spec.tile == 256:
        return FP8_D256_SPILL_LIMIT
    return VARLEN_BACKWARD_SPILL_LIMIT if spec.family == "backward_tc" and spec.features & FEATURE_VARLEN else 0


CASES = [(spec, arch) for spec in families.all_module_specs() for arch in ARCHS if arch in spec.archs]


@pytest.fixture(scope="module")
def reports(request):
    # Several minutes on two cores: a line every 25 modules (and the first) on the terminal, past
    # pytest's capture, so a long run shows where it is.
    terminal = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    started = time.time()

    def progress(done, total, case):
        if terminal is not None and capture is not None and (done == 1 or done % 25 == 0 or done == total):
            spec, arch = case
            with capture.global_and_fixture_disabled():   # fd capture would swallow it during setup
                terminal.write_line(f"compile check: {done}/{total} modules built ({time.time() - started:.0f} s; "
                                    f"last {spec.describe()} for {arch})")

    return _compile.compile_all_offline([spec for spec, _ in CASES], ARCHS, progress=progress)


@pytest.mark.compile
@pytest.mark.parametrize("spec,arch", CASES, ids=[f"{s.family}-{s.dtype}-{s.tile}{'-' + s.target if s.target else ''}-f{s.features}-{a}" for s, a in CASES])
def test_instantiations_compile_without_spills(reports, spec, arch):
    report = reports[(spec, arch)]
    if isinstance(report, Exception):
        raise report
    assert report.cubin_bytes > 0
    assert set(report.cubin_kernels) == set(spec.kernels), f"cubin holds {set(report.cubin_kernels)}"
    if not report.from_cubin:
        # Where ptxas reports (NVRTC 12), the cubin reads the same: the stand-in for an NVRTC that
        # gives no report (13, at times) is held to it on every module.
        for kernel in report.kernels:
            assert report.cubin_kernels[kernel.name] == (kernel.registers, kernel.stack_bytes), kernel.name
    names = {k.name for k in report.kernels}
    assert names == set(spec.kernels), f"ptxas reported {names}; its log:\n{report.log[-3000:]}"
    limit = spill_limit(spec)
    for kernel in report.kernels:
        assert kernel.spill_store_bytes <= limit and kernel.spill_load_bytes <= limit, (
            f"{kernel.name} spills on {arch}: {kernel.spill_store_bytes} B stored, "
            f"{kernel.spill_load_bytes} B loaded (limit {limit})\n{report.log}")
        assert kernel.stack_bytes <= limit, f"{kernel.name} has a {kernel.stack_bytes} B stack frame on {arch}"
        assert kernel.registers <= 255
    assert not report.speed_warnings, f"ptxas on {spec.describe()} for {arch}: {report.speed_warnings}"


@pytest.mark.compile
def test_kernel_figures_come_from_the_cubin_without_a_ptxas_report():
    """An NVRTC that returns no ptxas report (13, at times) still has every kernel checked: its
    registers and stack frame are read from the cubin, equal to what ptxas reports."""
    from cupy_flash._features import FEATURE_VARLEN

    # a module whose kernels spill (a non-zero frame to read), and a Hopper one
    spilling = next(s for s in families.all_module_specs()
                    if s.family == "backward_tc" and s.target == "sm80" and s.features & FEATURE_VARLEN)
    hopper = next(s for s in families.all_module_specs() if s.family == "forward_sm90")
    for spec in (spilling, hopper):
        arch = spec.archs[0]
        reported = _compile.compile_offline(spec, arch)
        unreported = _compile.compile_offline(spec, arch, ptxas_report=False)
        assert not reported.from_cubin and unreported.from_cubin and "Used" not in unreported.log
        figures = {k.name: (k.registers, k.stack_bytes, k.max_threads, k.param_bytes) for k in reported.kernels}
        assert {k.name: (k.registers, k.stack_bytes, k.max_threads, k.param_bytes) for k in unreported.kernels} == figures
        assert all(k.spill_store_bytes == k.spill_load_bytes == k.stack_bytes for k in unreported.kernels)
        if spec is spilling:
            assert any(k.stack_bytes > 0 for k in unreported.kernels), "no frame read: the check would be blind"


def test_speed_warnings_cover_serialised_wgmma():
    """The ptxas codes the suite fails on: C7508 and C7510-C7529 (wgmma serialised; C7520, an arrive
    ptxas inserted on a divergent path, was let through by an earlier pattern and cost 3-8%)."""
    report = _compile.CompileReport(spec=None, arch="sm_90a", cubin_bytes=0, kernels=[], log="")
    for code, caught in (("C7508", True), ("C7507", False), ("C7515", True), ("C7518", True), ("C7520", True),
                         ("C7529", True), ("C7530", False)):
        report.log = f"ptxas info    : ({code}) Potential Performance Loss: wgmma.mma_async instructions are serialized"
        assert bool(report.speed_warnings) == caught, code


HOPPER_FAMILIES = ("forward_sm90", "backward_sm90", "decode_sm90")


def hopper_kernels(reports):
    """(module spec, kernel report) of every Hopper kernel that compiled."""
    for (spec, _), report in reports.items():
        if spec.family in HOPPER_FAMILIES and not isinstance(report, Exception):
            for kernel in report.kernels:
                yield spec, kernel


@pytest.mark.compile
def test_hopper_launchers_match_their_kernels(reports):
    """Each Hopper launch's block size and argument record (Python: _traits, forward.py,
    backward.py) against the kernel's launch bounds and parameters (its PTX): a block short of a
    warpgroup, or a tensor-map record shorter than the kernel's struct, would fail only on an H100."""
    import ctypes

    from cupy_flash import backward, forward, forward_fp8
    from cupy_flash._params import PARAMS_DTYPE

    launches = {"forward_sm90": (sm90.forward_sm90_threads, (forward._SM90_MAPS_BYTES, PARAMS_DTYPE.itemsize, 8)),
                "backward_sm90": (sm90.backward_sm90_threads, (backward._SM90_MAPS_BYTES, PARAMS_DTYPE.itemsize, 8)),
                "decode_sm90": (lambda config: _traits.MLA_SM90_THREADS, (_tma.MAP_BYTES, PARAMS_DTYPE.itemsize))}
    checked = 0
    for spec, kernel in hopper_kernels(reports):
        threads, record = launches[spec.family]
        if kernel.name.startswith("fp8_transpose_v"):   # the FP8 forward's V^T pass
            expected = (_traits.FP8_TRANSPOSE_THREADS, tuple(ctypes.sizeof(kind) for kind in forward_fp8.TRANSPOSE_PARAMETERS))
        elif kernel.name.startswith("flash_backward_dq_sm90_kernel"):   # dQ apart: no tile counter
            expected = (sm90.backward_dq_sm90_threads(sm90.backward_sm90_module_dq_apart(spec.tile, spec.features)[0]),
                        (backward._SM90_MAPS_BYTES, PARAMS_DTYPE.itemsize))
        else:
            expected = (threads(spec.config), record)
        assert (kernel.max_threads, kernel.param_bytes) == expected, kernel.name
        checked += 1
    assert checked == sum(len(spec.kernels) for spec in families.all_module_specs() if spec.family in launches)


@pytest.mark.compile
def test_fp8_dequantize_launcher_matches_its_kernel(reports):
    """The FP8 backward's dequantisation (backward_fp8.DEQUANTIZE_PARAMETERS, a row kernel's block)
    against fp8_dequantize_kernel's parameters and launch bounds, on every arch."""
    import ctypes

    from cupy_flash import backward_fp8

    expected = (_traits.ROW_KERNEL_THREADS, tuple(ctypes.sizeof(kind) for kind in backward_fp8.DEQUANTIZE_PARAMETERS))
    checked = 0
    for (spec, _), report in reports.items():
        if spec.family == "preprocess" and not isinstance(report, Exception):
            for kernel in report.kernels:
                if kernel.name.startswith("fp8_dequantize_kernel"):
                    assert (kernel.max_threads, kernel.param_bytes) == expected, kernel.name
                    checked += 1
    assert checked > 0


@pytest.mark.compile
def test_hopper_kernels_reach_shared_memory_as_shared(reports):
    """No generic loads or stores in the Hopper kernels (PTX): shared storage reached through a
    pointer that lost its address space (an integer cast) compiles to generic LD.E / ST.E, and the
    backward's dQ staging then waited at its proxy fence (docs/decisions.md, "shared storage keeps
    its address space": the fix gained 4-11%)."""
    checked = 0
    for _, kernel in hopper_kernels(reports):
        assert kernel.generic_accesses == 0, f"{kernel.name}: {kernel.generic_accesses} generic loads / stores"
        checked += 1
    assert checked > 0


def test_every_head_dim_maps_to_a_compiled_tile():
    for head_dim in range(8, _traits.MAX_HEAD_DIM + 1, 8):
        tile = _traits.head_dim_tile(head_dim)
        padding = 32 if head_dim <= _traits.WIDE_TILE else 64   # FlashAttention-2's tiles, then steps of 64
        assert tile in _traits.HEAD_DIM_TILES and head_dim <= tile < head_dim + padding
    # Decoding's own tiles (MLA's 576) beyond: the widest is refused past.
    assert [_traits.head_dim_tile(d) for d in (_traits.MAX_HEAD_DIM + 8, _traits.DECODE_MAX_HEAD_DIM)] == [576, 576]
    with pytest.raises(ValueError, match="exceeds 576"):
        _traits.head_dim_tile(_traits.DECODE_MAX_HEAD_DIM + 1)


@pytest.mark.parametrize("tile", _traits.HEAD_DIM_TILES)
def test_shared_memory_fits_every_sm80_plus_part(tile):
    """To 256 every kernel fits every sm_80+ part (99 KB a block); wider tiles what fits where: the
    forwards everywhere, the float32 backward on sm_80-class parts from 448 (families.check_smem
    refuses it below), the tensor-core backward on sm_80 to 448 and on sm_90, decoding on sm_80
    (also at 192-256: on sm_8x parts from 192 check_smem refuses it)."""
    sm8x = [cuda_core.forward_smem_bytes(tile), tensor_core.forward_tc_smem_bytes(tile, "sm8x")]
    backward = [cuda_core.backward_smem_bytes(tile), cuda_core.backward_dq_smem_bytes(tile)]
    for smem in sm8x + (backward if tile <= 384 else []):
        assert smem <= _traits.SMEM_LIMIT_BYTES
    for smem in backward:
        assert smem <= _traits.TARGET_SMEM_BYTES["sm80"]
    # The other tables are only chosen where the device allows them.
    for target in _traits.TENSOR_CORE_TARGETS:
        limit = _traits.TARGET_SMEM_BYTES[target]
        assert tensor_core.forward_tc_smem_bytes(tile, target) <= limit
        if tile in tensor_core.BACKWARD_TC_TARGETS[target]:
            assert tensor_core.backward_tc_smem_bytes(tile, target) <= limit
    assert (tile in tensor_core.BACKWARD_TC_TARGETS["sm8x"]) == (tile <= _traits.WIDE_TILE)
    assert (tile in tensor_core.BACKWARD_TC_TARGETS["sm80"]) == (tile <= 448)
    assert tile in tensor_core.BACKWARD_TC_TARGETS["sm90"]
    assert _traits.decode_smem_bytes(tile) <= _traits.TARGET_SMEM_BYTES["sm80"]


@pytest.mark.parametrize("tile", _traits.DECODE_ONLY_TILES)
def test_decode_only_tiles_fit_sm80(tile):
    """MLA's 576 (decoding only): its v columns split over blocks, within sm_80's shared memory;
    from an FP8 cache (raw and converted stages) within sm_90's (check_smem refuses it elsewhere)."""
    assert _traits.v_split(tile) == _traits.V_SPLIT and _traits.v_tile(tile) * _traits.V_SPLIT == _traits.MAX_HEAD_DIM
    assert _traits.decode_smem_bytes(tile) <= _traits.TARGET_SMEM_BYTES["sm80"]
    assert _traits.decode_smem_bytes(tile, fp8_cache=True) <= _traits.TARGET_SMEM_BYTES["sm90"]


def test_every_hopper_instantiation_is_built_by_ci():
    """Each Hopper module CI builds has its tile table's config (the forward's for causal calls and
    the others; the backward's for plain and variant calls), and every feature set the dispatch
    accepts is among them (a flag set the rule sends to sm_90a is compiled and checked)."""
    built = {(s.family, s.dtype, s.tile, s.features, s.config) for s in families.all_module_specs()}
    for dtype in _compile.TENSOR_CORE_DTYPES:
        for tile, sets in sm90.FORWARD_SM90_FEATURE_SETS.items():
            for flags in (0,) + sets:
                for causal, keys in ((False, 1), (True, 1), (True, 1 << 20)):
                    assert ("forward_sm90", dtype, tile, flags, sm90.forward_sm90_config(tile, flags, causal, keys)) in built
        for tile, sets in sm90.BACKWARD_SM90_FEATURE_SETS.items():
            for flags in (0,) + sets:
                assert ("backward_sm90", dtype, tile, flags, sm90.backward_sm90_config(tile, flags)) in built, (tile, flags)


def test_generated_wgmma_operations_are_current_and_cover_the_tiles():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "generate_wgmma_ops.py"
    spec = importlib.util.spec_from_file_location("generate_wgmma_ops", path)
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    assert generator.OUTPUT.read_text() == generator.source(), (
        "kernels_cu/sm90_wgmma_ops.cuh is stale: run python -m bench.generate_wgmma_ops")
    assert generator.WIDTHS is sm90.SM90_WGMMA_WIDTHS
    for tile, (_, block_n, _) in list(sm90.FORWARD_SM90.items()) + list(sm90.FORWARD_SM90_PLAIN.items()):
        v_width = sm90.FORWARD_SM90_V_BLOCK if tile > _traits.WIDE_TILE else tile   # O += P V's N
        assert v_width in generator.WIDTHS and block_n in generator.WIDTHS, (tile, block_n)
    # the key split's N; the head-dim split's halves (d = 256), and the product split's whole query
    # block and consumers' chunks of dK and dV (kernels_cu/backward_sm90.cu, product_split_columns:
    # 128 each at 256, 64 and 128 at 192)
    for tile, (_, block_m, _) in list(sm90.BACKWARD_SM90.items()) + list(sm90.BACKWARD_SM90_PLAIN.items()):
        columns = (tile // 2,) if tile == 256 else (64, tile - 64)
        halves = (tile // _traits.BACKWARD_SM90_CONSUMERS, block_m // _traits.BACKWARD_SM90_CONSUMERS, block_m) + columns
        assert set((tile, block_m) if tile <= 128 else halves) <= set(generator.WIDTHS), tile


def test_feature_bits_are_defined_once():
    """The FEATURE_* bits come from _features (prepended to every family's source), never from a
    #define in kernels_cu/, so Python and CUDA cannot disagree."""
    import re
    from pathlib import Path

    from cupy_flash import _features

    for path in (Path(__file__).resolve().parents[1] / "kernels_cu").glob("*.cu*"):
        assert not re.search(r"#define\s+FEATURE_", path.read_text()), path.name
    source = _compile.family_source("forward_tc")
    for bit, name in _features.FEATURE_NAMES.items():
        assert f"#define FEATURE_{name.upper()} {bit}\n" in source


def test_tensor_core_target_follows_the_device():
    assert _traits.tensor_core_target(90, 227 * 1024) == "sm90"
    assert _traits.tensor_core_target(80, 163 * 1024) == "sm80"
    assert _traits.tensor_core_target(86, 99 * 1024) == "sm8x"
    assert _traits.tensor_core_target(89, 99 * 1024) == "sm8x"


def test_flash_params_is_written_from_the_python_record():
    """FlashParams has one definition, _params.FIELDS: every module's source holds the struct that
    _params.cuda_struct writes from it, once, in the interface header common.cuh includes before
    its own code, and no file of kernels_cu defines it; the struct's fields are PARAMS_DTYPE's, in
    order, with their sizes."""
    from cupy_flash import _params

    struct = _params.cuda_struct()
    for family in _compile.FAMILIES:
        source = _compile.family_source(family)
        assert source.count("struct FlashParams {") == 1 and source.index(struct) < source.index("struct fa_f16")
    for path in _compile._kernel_dir().iterdir():
        assert "struct FlashParams {" not in path.read_text(), path.name
    fields = re.findall(r"^    (.+?) (\w+)(?:\[(\d+)\])?;$", struct, re.M)
    sizes = {"long long": 8, "float": 4}
    assert [name for _, name, _ in fields] == list(_params.PARAMS_DTYPE.names)
    for c_type, name, count in fields:
        expected = 8 if c_type.endswith("*") else sizes[c_type] * int(count or 1)
        assert _params.PARAMS_DTYPE.fields[name][0].itemsize == expected, name


def test_configuration_values_are_stated_once():
    """The values both the launch code and the kernels need (threads, consumer warpgroups, the sm_90
    block's shared memory, the row and decode kernels' shapes) are _traits' and reach every module
    as #defines in the interface header; kernels_cu states none of them itself."""
    import re

    defines = dict(re.findall(r"#define (\w+) (\d+)", _traits.cuda_defines()))
    assert defines["SM90_BLOCK_SMEM_BYTES"] == str(227 * 1024) and defines["FLASH_THREADS"] == str(_traits.THREADS)
    for path in _compile._kernel_dir().glob("*.cu*"):
        text = path.read_text()
        assert "227 * 1024" not in text, path.name
        for name in defines:
            assert not re.search(rf"(#define|constexpr int)\s+{name}\b", text), (path.name, name)
    for family in _compile.FAMILIES:
        assert _traits.cuda_defines() in _compile.family_source(family), family


def test_every_kernel_file_is_a_family_or_a_header_and_includes_what_it_uses():
    """kernels_cu holds the families' .cu files and the headers they include; each file is expanded
    into its source once, and no #include is left over."""
    names = {path.name for path in _compile._kernel_dir().iterdir()}
    used = {header for family in _compile.FAMILIES for header in _compile.family_headers(family)}
    assert names == {f"{family}.cu" for family in _compile.FAMILIES} | (used - {_compile.INTERFACE_HEADER})
    for family in _compile.FAMILIES:
        source = _compile.family_source(family)
        assert "#include" not in source and "#pragma once" not in source
        for header in _compile.family_headers(family):
            assert source.count(f"// ---- {header} ----") == 1, (family, header)


@pytest.mark.compile
@pytest.mark.parametrize("name", sorted(set(_compile.headers()) - {_compile.INTERFACE_HEADER}) + [f"{f}.cu" for f in _compile.FAMILIES])
def test_each_kernel_file_compiles_on_its_own(name):
    """Each header and each family's file compiles alone through NVRTC's in-memory headers (the
    #includes it names, nothing prepended), to the same PTX as the source the package compiles."""
    from cupy_backends.cuda.libs import nvrtc

    headers = _compile.headers()
    family = name[:-3] if name.endswith(".cu") else None
    spec = next(s for s in families.all_module_specs() if s.family == family) if family else None
    arch = "compute_90a" if family and family.endswith("sm90") else "compute_80"

    def ptx(text, with_headers):
        program = nvrtc.createProgram(text, name, [h.encode() for h in headers.values()] if with_headers else [],
                                      [h.encode() for h in headers] if with_headers else [])
        try:
            for expression in (spec.name_expressions if spec else ()):
                nvrtc.addNameExpression(program, expression)
            try:
                nvrtc.compileProgram(program, list(_compile.compile_options(arch, report=False)))
            except nvrtc.NVRTCError:
                raise AssertionError(f"{name} does not compile alone:\n{nvrtc.getProgramLog(program)}") from None
            return nvrtc.getPTX(program)
        finally:
            nvrtc.destroyProgram(program)

    text = headers[name] if family is None else (_compile._kernel_dir() / name).read_text()
    alone = ptx(text, True)
    if family is not None:
        assert alone == ptx(_compile.family_source(family), False)


@pytest.mark.compile
def test_cubin_identity_hashes_each_kernels_sass():
    """bench/cubin_identity.py (the proof that a change leaves the kernels alone) finds one SASS
    section per kernel of a module, and the same hashes for the same source."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "cubin_identity.py"
    loader = importlib.util.spec_from_file_location("cubin_identity", path)
    tool = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(tool)
    spec = next(s for s in families.all_module_specs() if s.family == "preprocess")
    name, first = tool._module((spec, "sm_80"))
    _, second = tool._module((spec, "sm_80"))
    lowered = _compile._nvrtc_compile(spec, _compile.compile_options("sm_80", report=False))[1]
    assert set(first["sass"]) == {f".text.{mangled}" for mangled in lowered.values()}
    assert first == second and tool.compare({name: first}, {name: second}) == 0
    assert tool.compare({name: first}, {name: {**second, "sass": {}}}) == 1
    assert set(first["ptx"]) == set(lowered.values())
    # the PTX hash ignores register numbers and labels, not instructions
    ptx = "// a module\n.visible .entry k(\n)\n{\n\t.reg .f32 \t%f<3>;\n$L__BB0_1:\n\tadd.f32 \t%f1, %f2, %f2;\n}\n"
    renamed = ptx.replace("%f<3>", "%f<9>").replace("%f1", "%f7").replace("$L__BB0_1", "$L__BB0_4")
    assert tool.ptx_entries(ptx) == tool.ptx_entries(renamed) != tool.ptx_entries(ptx.replace("add.f32", "sub.f32"))
