"""CPU: the dispatch rule (cupy_flash/families/, docs/api.md "Which kernels run") on made-up devices."""

import types

import pytest
from helpers import FakeGpuArray

from cupy_flash import _traits, families
from cupy_flash._checks import AttentionShape
from cupy_flash._features import FEATURE_BIAS, FEATURE_HEAD_DIM_V, FEATURE_SOFTCAP, FEATURE_VARLEN, FEATURE_WINDOW
from cupy_flash.families import sm90

H100 = families.DeviceInfo(90, 227 * 1024, 132)
A100 = families.DeviceInfo(80, 163 * 1024, 108)
L40 = families.DeviceInfo(89, 99 * 1024, 142)
B200 = families.DeviceInfo(100, 227 * 1024, 148)   # sm_90a code does not run on sm_100


def family(device, dtype="bfloat16", head_dim=128, flags=0, setting="auto", causal=False, seqlen=1000):
    shape = AttentionShape(2, seqlen, seqlen, 8, head_dim, dtype)
    return families.forward_family(device, shape, types.SimpleNamespace(flags=flags, causal=causal), setting).name


@pytest.mark.parametrize("head_dim", [8, 64, 72, 128, 136, 200, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_hopper_takes_16_bit_calls_on_compute_capability_9_0(dtype, head_dim):
    assert family(H100, dtype, head_dim) == "forward_sm90"
    for flags in (FEATURE_WINDOW, FEATURE_SOFTCAP | FEATURE_VARLEN, FEATURE_WINDOW | FEATURE_SOFTCAP):
        assert family(H100, dtype, head_dim, flags) == "forward_sm90"


def test_short_causal_calls_run_the_hopper_kernels_too():
    # Measured: 1.22-1.34x the mma.sync kernels at 128-512 keys, head_dim 64 (_traits, FORWARD_SM90).
    for head_dim in (64, 128, 256):
        for seqlen in (1, 100, 512, 513):
            assert family(H100, head_dim=head_dim, causal=True, seqlen=seqlen) == "forward_sm90"
    assert family(H100, head_dim=64, causal=False, seqlen=512) == "forward_sm90"


def test_the_rest_runs_the_portable_kernels():
    assert family(H100, flags=FEATURE_BIAS) == "forward_tc"
    assert family(H100, flags=FEATURE_BIAS | FEATURE_WINDOW) == "forward_tc"
    assert family(H100, "float32") == "forward"
    assert family(H100, setting="portable") == "forward_tc"
    for device in (A100, L40, B200):
        assert family(device) == "forward_tc"
        assert family(device, "float32") == "forward"


def test_wide_head_dims_run_the_portable_kernels_or_say_why_not():
    """Above 256 (to 512) the Hopper forward (the 512 tile, v blocks of 256) runs float16/bfloat16
    forwards on the H100 and the portable families the rest; where a part's shared memory holds no
    tile of a kernel, the call is refused before launch, naming the head dim and both sizes."""
    plain = types.SimpleNamespace(flags=0, backward_flags=0, causal=False)
    for head_dim, head_dim_v in ((264, 264), (512, 512), (256, 512), (512, 128)):
        for dtype, portable in (("bfloat16", ("forward_tc", "backward_tc")), ("float32", ("forward", "backward"))):
            shape = AttentionShape(2, 4096, 4096, 8, head_dim, dtype, 8, head_dim_v)
            for device in (H100, A100, L40):
                hopper = device is H100 and dtype == "bfloat16"
                assert (families.forward_family(device, shape, plain, "auto").name,
                        families.backward_family(device, shape, plain, setting="auto").name) == (
                    ("forward_sm90",) + portable[1:] if hopper else portable)
                if hopper:
                    config = sm90.forward_sm90_config(512, 0)
                    assert config == (128, 512, 32, 2, 256)
                    assert sm90.forward_sm90_v_blocks(config, head_dim_v) == -(-head_dim_v // 256)
    tc = families.tensor_core
    wide = AttentionShape(2, 1000, 1000, 8, 256, "bfloat16", 8, 512)
    assert tc.Backward.backward_schedule(H100, wide, plain, False).block_m == 64
    for device, words in ((A100, "needs 209408 bytes"), (L40, "needs 209408 bytes")):
        with pytest.raises(ValueError, match=f"the backward at head_dim 512 {words} of shared memory per block; "
                                             f"this GPU allows {device.smem_per_block}"):
            tc.Backward.backward_schedule(device, wide, plain, False)
    with pytest.raises(ValueError, match="the backward at head_dim 320 needs 110080 bytes"):
        tc.Backward.backward_schedule(L40, AttentionShape(1, 64, 64, 1, 320, "float16"), plain, False)
    check = families.check_smem
    check(A100, 163 * 1024, wide, "decoding")
    with pytest.raises(ValueError, match="decoding at head_dim 512 needs 166913 bytes"):
        check(A100, 163 * 1024 + 1, wide, "decoding")


def backward(device, head_dim=128, seqlen=4096, deterministic=False, flags=0, setting="auto", causal=False):
    shape = AttentionShape(2, seqlen, seqlen, 8, head_dim, "bfloat16")
    return families.backward_family(device, shape, types.SimpleNamespace(backward_flags=flags, causal=causal),
                                    deterministic, setting=setting).name


def test_the_hopper_backward_runs_where_it_measured_faster():
    # sm90.BACKWARD_SM90_MIN_KEYS and BACKWARD_SM90_DETERMINISTIC_MIN_KEYS (H100, bf16 and fp16).
    for head_dim in (64, 128, 256):
        for causal in (False, True):
            for deterministic in (False, True):
                assert backward(H100, head_dim=head_dim, seqlen=256, causal=causal, deterministic=deterministic) == "backward_sm90"
                assert backward(H100, head_dim=head_dim, seqlen=255, causal=causal, deterministic=deterministic) == "backward_tc"
    assert backward(H100, head_dim=96, seqlen=4096, flags=FEATURE_WINDOW | FEATURE_VARLEN) == "backward_sm90"
    assert backward(H100, head_dim=192, seqlen=4096, deterministic=True, causal=True) == "backward_sm90"
    # "experimental" (the tests' hopper path) wherever it runs; never score modifiers, or off sm_90.
    assert backward(H100, seqlen=100, deterministic=True, setting="experimental") == "backward_sm90"
    assert backward(H100, head_dim=256, seqlen=100, setting="experimental") == "backward_sm90"
    assert backward(H100, setting="portable") == "backward_tc"
    assert backward(H100, flags=FEATURE_SOFTCAP) == backward(H100, flags=FEATURE_BIAS) == "backward_tc"
    for device in (A100, L40, B200):
        assert backward(device) == backward(device, setting="experimental") == "backward_tc"


def test_the_hopper_backward_computes_dq_apart_where_it_measured_faster():
    # sm90.BACKWARD_SM90_DQ_APART_KEYS: every plain call at d = 256; deterministic plain calls
    # at d = 64 (any length with a causal mask, up to 2k keys without) and d = 128 (up to 2k keys);
    # never a call with variant flags, whose kernels keep the dQ adds.
    apart = sm90.backward_sm90_dq_apart
    for causal in (False, True):
        for keys in (256, 2048, 2049, 16384):
            assert apart(256, 0, False, causal, keys) == apart(256, 0, True, causal, keys) == sm90.BACKWARD_SM90_DQ_APART[256]
            assert apart(64, 0, False, causal, keys) is None and apart(128, 0, False, causal, keys) is None
            for tile in (64, 128, 256):
                assert apart(tile, FEATURE_WINDOW, True, causal, keys) is None
        assert apart(128, 0, True, causal, 2048) is not None and apart(128, 0, True, causal, 2049) is None
    assert apart(64, 0, True, True, 16384) is not None
    assert apart(64, 0, True, False, 2048) is not None and apart(64, 0, True, False, 2049) is None
    # What the modules compile: d = 256 plain only the kernels without dQ adds, d = 64 / 128 both.
    assert sm90.backward_sm90_module_dq_apart(256, 0) == (sm90.BACKWARD_SM90_DQ_APART[256], False)
    assert sm90.backward_sm90_module_dq_apart(128, 0) == (sm90.BACKWARD_SM90_DQ_APART[128], True)
    assert sm90.backward_sm90_module_dq_apart(256, FEATURE_WINDOW) == (None, True)
    # d = 192's tile: every call dQ apart (the product split only), so its modules hold no dQ adds
    for causal in (False, True):
        for deterministic in (False, True):
            assert apart(192, 0, deterministic, causal, 16384) == sm90.BACKWARD_SM90_DQ_APART[192]
    assert sm90.backward_sm90_module_dq_apart(192, 0) == (sm90.BACKWARD_SM90_DQ_APART[192], False)
    assert sm90.backward_sm90_module_dq_apart(192, FEATURE_HEAD_DIM_V) == (sm90.BACKWARD_SM90_DQ_APART[192], False)


def test_the_hopper_backward_tile_is_the_narrowest_that_compiles_the_call():
    """sm90.backward_sm90_tile: d 129-192 take the 192 tile when plain (v's own head_dim too), the
    256 tile with any other backward flag (BACKWARD_SM90_FEATURE_SETS: the 192 tile has no dQ adds)."""
    tile = sm90.backward_sm90_tile
    assert tile(64) == 64 and tile(128) == 128 and tile(129) == tile(192) == 192 and tile(200) == 256
    assert tile(192, FEATURE_HEAD_DIM_V) == 192
    for flags in (FEATURE_WINDOW, FEATURE_VARLEN, FEATURE_WINDOW | FEATURE_HEAD_DIM_V):
        assert tile(160, flags) == tile(192, flags) == 256 and tile(128, flags) == 128


def test_only_calls_that_add_dq_zero_a_float32_accumulator():
    """Each family's schedule plans a float32 dQ accumulator (which the preprocess zeroes) only where
    its kernels add into one: calls that compute dQ apart never read it (measured: a plain d = 256
    atomic call planned and zeroed one, as many bytes as q twice)."""
    from cupy_flash.families import cuda_core, sm90, tensor_core

    plain = types.SimpleNamespace(backward_flags=0, causal=False)
    for deterministic in (False, True):   # d = 256: dQ apart for every plain call
        apart = sm90.Backward.backward_schedule(H100, AttentionShape(2, 4096, 4096, 8, 256, "bfloat16"), plain, deterministic)
        assert apart.dq_apart and not (apart.dq_accum or apart.dq_convert or apart.dq_semaphores)
    adds = sm90.Backward.backward_schedule(H100, AttentionShape(2, 4096, 4096, 8, 128, "bfloat16"), plain, True)
    assert adds.dq_apart is None and adds.dq_accum and adds.dq_convert and adds.dq_semaphores   # the ordered adds
    shape = AttentionShape(2, 1000, 1000, 8, 128, "bfloat16")
    for deterministic in (False, True):
        tc = tensor_core.Backward.backward_schedule(A100, shape, plain, deterministic)
        assert tc.dq_accum and tc.dq_convert and tc.dq_semaphores == deterministic
        assert tc.row_multiple == _traits.ROW_STAT_PADDING
    fp32 = AttentionShape(2, 1000, 1000, 8, 128, "float32")
    atomic, ordered = (cuda_core.Backward.backward_schedule(A100, fp32, plain, d) for d in (False, True))
    assert atomic.dq_accum and atomic.dq_convert
    assert not (ordered.dq_accum or ordered.dq_convert)   # the dQ pass writes dq


def test_the_setting_comes_from_the_environment_or_use_kernels(monkeypatch):
    monkeypatch.setenv(families.KERNELS_VARIABLE, "portable")
    assert families.kernels_setting() == "portable"
    monkeypatch.setenv(families.KERNELS_VARIABLE, "auto")
    with families.use_kernels("portable"):
        assert families.kernels_setting() == "portable"
    assert families.kernels_setting() == "auto"
    monkeypatch.setenv(families.KERNELS_VARIABLE, "fast")
    with pytest.raises(ValueError, match="CUPY_FLASH_KERNELS"):
        families.kernels_setting()
    with pytest.raises(ValueError, match="kernels setting"):
        with families.use_kernels("hopper"):
            pass


def test_info_names_the_path_of_each_dtype():
    lines = families.describe_forward(H100, "auto")
    assert lines[0].startswith("bfloat16: Hopper kernels") and "with a bias: tensor-core" in lines[0]
    assert lines[2].startswith("float32: CUDA-core")
    assert families.describe_forward(H100, "portable")[0].startswith("bfloat16: tensor-core")
    assert families.describe_forward(A100, "auto")[1].startswith("float16: tensor-core")
    assert families.describe_backward(H100, "auto").startswith(
        "float16/bfloat16: Hopper kernels from 256 keys; deterministic calls too (head_dim <= 256;")
    assert families.describe_backward(H100, "auto").endswith(
        "dQ in a kernel of its own (no window, no packed batch): head_dim 1-64: deterministic non-causal up to 2048 "
        "keys, deterministic causal (any length); head_dim 65-128: deterministic non-causal up to 2048 keys, deterministic causal "
        "up to 2048 keys; head_dim 129-256: every call")
    assert families.describe_backward(H100, "portable").startswith("float16/bfloat16: tensor-core")
    assert families.describe_backward(H100, "experimental").startswith("float16/bfloat16: Hopper kernels")
    assert families.describe_backward(A100, "experimental") == "float16/bfloat16: tensor-core kernels (mma.sync; sm_80+)"


def test_tma_takes_any_stride_on_axes_of_size_one():
    """x[None] gives its new axis stride 0 (seen on the H100: a batch of one fell back to the
    portable kernels); a size-one axis is never stepped along, so any stride there is fine."""
    from cupy_flash import _tma

    dense = FakeGpuArray((2, 640, 4, 64), (640 * 4 * 128, 4 * 128, 128, 2))
    assert _tma.maps_supported(dense)
    for shape, strides in (((1, 640, 4, 64), (0, 512, 128, 2)),        # x[None]
                           ((3, 1, 4, 64), (512, 0, 128, 2)),          # one query row
                           ((3, 640, 1, 64), (640 * 128, 128, 7, 2)),  # one head, odd stride
                           ((5, 1, 3, 64), (16 * 3 * 128, 99, 128, 2))):
        array = FakeGpuArray(shape, strides)
        assert _tma.maps_supported(array), shape
        assert all(s > 0 and s % 16 == 0 for s in _tma.map_strides(array, packed=False))
    assert _tma.map_strides(FakeGpuArray((1, 640, 4, 64), (0, 512, 128, 2)), packed=False) == (512, 128, 128)
    assert not _tma.maps_supported(FakeGpuArray((2, 640, 4, 64), (640 * 4 * 128, 4 * 136, 136, 2)))  # 136 % 16
    assert not _tma.maps_supported(FakeGpuArray((2, 640, 4, 64), (640 * 4 * 128, 4 * 128, 128, 2), ptr=(1 << 20) + 8))
    packed = FakeGpuArray((1, 3, 64), (0, 128, 2))
    assert _tma.maps_supported(packed) and _tma.map_strides(packed, packed=True) == (128, 128, 128)


def test_plain_causal_tiles_from_moves_the_threshold_and_drops_plans():
    """forward.plain_causal_tiles_from (the GPU tests' hopper path, the sanitizer workload): inside,
    plain causal calls take FORWARD_SM90_PLAIN's tiles from the given keys; plans made under either
    rule are dropped (their key does not hold it), and the table's threshold comes back."""
    from cupy_flash import forward

    tile = next(iter(sm90.FORWARD_SM90_PLAIN))
    table_before = dict(sm90.FORWARD_SM90_PLAIN_CAUSAL_MIN_KEYS)
    plain, table = sm90.forward_sm90_config(tile), sm90.forward_sm90_config(tile, causal=True, seqlen_k=100)
    assert plain != table   # 100 keys is under the threshold
    forward._plans["made outside"] = object()
    with forward.plain_causal_tiles_from(100):
        assert not forward._plans
        assert sm90.forward_sm90_config(tile, causal=True, seqlen_k=100) == plain
        assert sm90.forward_sm90_config(tile, causal=True, seqlen_k=99) == table
        assert sm90.forward_sm90_config(tile, 1, causal=True, seqlen_k=4096) == sm90.forward_sm90_config(tile, 1)
        forward._plans["made inside"] = object()
    assert not forward._plans
    assert sm90.forward_sm90_config(tile, causal=True, seqlen_k=100) == table
    assert sm90.FORWARD_SM90_PLAIN_CAUSAL_MIN_KEYS == table_before   # never written


def test_plain_backward_calls_take_the_plain_tiles():
    """sm90.backward_sm90_config: plain calls (flags 0) take BACKWARD_SM90_PLAIN's tiles, variant
    calls BACKWARD_SM90's (tests/test_compile.py checks CI builds both)."""

    for tile in sm90.BACKWARD_SM90:
        plain = sm90.backward_sm90_config(tile)
        assert plain[1:] == sm90.BACKWARD_SM90_PLAIN.get(tile, sm90.BACKWARD_SM90[tile])
        assert sm90.backward_sm90_config(tile, FEATURE_WINDOW)[1:] == sm90.BACKWARD_SM90[tile]


def test_backward_row_kernels_take_a_grid_the_multiprocessors_hold(monkeypatch):
    """The row kernels' warps loop over the rows: a large call gets a grid sized to the device (the
    grid of a warp per row left most blocks without a row), a small one no more blocks than rows
    need."""
    from cupy_flash.families import rows

    monkeypatch.setattr(rows, "current_device", lambda: H100)
    monkeypatch.setattr(rows, "get_kernel", lambda spec, name: name)
    large = AttentionShape(8, 2048, 2048, 16, 128, "bfloat16")   # 262,144 rows
    launch = rows.row_launch(rows.PREPROCESS, large)
    assert (launch.grid, launch.threads) == (rows._ROW_BLOCKS_PER_SM * H100.multiprocessors, 256)
    assert launch.name == "flash_preprocess_kernel<fa_bf16>"
    small = AttentionShape(1, 100, 100, 2, 64, "bfloat16")   # 200 rows: 25 blocks of 8 warps
    assert rows.row_launch(rows.DQ_CONVERT, small).grid == 25


def test_hopper_backward_grid_is_persistent_for_atomic_calls():
    """sm90.grid_of: atomic calls one block per SM at most (blocks take key blocks from the
    kernel's counter), deterministic calls a block per key block."""
    from cupy_flash.families import sm90

    assert sm90.grid_of(4096, False, H100) == H100.multiprocessors
    assert sm90.grid_of(40, False, H100) == 40
    assert sm90.grid_of(4096, True, H100) == 4096


def test_v_with_a_head_dim_of_its_own_takes_its_own_hopper_tile_where_the_table_has_one():
    """DeepSeek's 192 / 128 (and pairs rounding to it) run S at q's tile and P V at v's
    (FORWARD_SM90_HEAD_DIM_V); other pairs, and one head_dim, the tile of the larger."""
    def shape(d, d_v):
        return AttentionShape(1, 512, 512, 4, d, "bfloat16", 4, d_v)

    block_m, block_n, stages = sm90.FORWARD_SM90_HEAD_DIM_V[(192, 128)]
    assert sm90.forward_sm90_head_dim_v_config(shape(192, 128)) == (block_m, 192, block_n, stages, 128)
    assert sm90.forward_sm90_head_dim_v_config(shape(136, 72)) == (block_m, 192, block_n, stages, 128)
    for d, d_v in ((192, 192), (128, 192), (256, 128), (192, 64), (64, 256)):
        assert sm90.forward_sm90_head_dim_v_config(shape(d, d_v)) is None, (d, d_v)
    spec = sm90.Forward.module_spec("bfloat16", 192, sm90._SM90_ALL, (block_m, 192, block_n, stages, 128))
    assert sm90.Forward.kernel(spec, True).endswith(f", true, {sm90._SM90_ALL}, 128>")
    assert spec in families.all_module_specs()
