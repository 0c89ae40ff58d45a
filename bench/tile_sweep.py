"""Choose the forward's tile shapes by measurement.

For each head-dim tile and each candidate, compile, check the output against the float64
reference, and time bf16 forward beside a PyTorch SDPA backend in the same process (same data, same
timing as python -m bench). Losers are worth recording in docs/performance.md.

    python -m bench.tile_sweep                     # the mma.sync forward's built-in candidates
    python -m bench.tile_sweep 128:32,4,2 128:64,4,2   # tile:block_n,num_warps,m_tiles
    python -m bench.tile_sweep --sm90              # the Hopper forward's (beside cuDNN)
    python -m bench.tile_sweep --sm90 128:128,176,2    # tile:block_m,block_n,stages

Run from the repository's root; needs a GPU and PyTorch (the peer).

The mma.sync candidates patch the tile tables; the Hopper ones are launched with their tile
arguments (ModuleSpec.config), the tables untouched.
"""

from __future__ import annotations

import cupy
import ml_dtypes
import numpy

import cupy_flash
from bench.attention import flops, make_sets, ours, time_calls, torch_peer, torch_sets
from cupy_flash import _compile
from cupy_flash.families import tensor_core

CANDIDATES = {
    64: [(64, 4, 2), (64, 8, 1), (128, 8, 1)],
    128: [(32, 4, 2), (64, 8, 1), (32, 8, 1)],
}
# (block_m, block_n, stages); the plain kernels of each compile without spills (NVRTC 12.9).
SM90_CANDIDATES = {
    64: [(128, 128, 2), (128, 192, 2), (192, 128, 2)],
    128: [(128, 128, 2), (128, 176, 2)],
    192: [(128, 112, 2), (128, 96, 2), (128, 80, 2)],
    256: [(128, 64, 2), (128, 80, 2)],
    512: [(128, 64, 1), (128, 32, 2)],   # v blocks of sm90.FORWARD_SM90_V_BLOCK columns
}
SEQLENS = (1024, 4096, 16384)


def use(tile, config):
    """Give every target's table ``config`` for ``tile`` (or, from a dict, each target its own)."""
    for target, table in tensor_core.FORWARD_TC_TARGETS.items():
        table[tile] = config[target] if isinstance(config, dict) else config
    _compile._modules.clear()
    _compile._functions.clear()


def sm90_forward(config):
    """flash_forward(q, k, v, causal=...) with the Hopper kernel's tile arguments ``config`` (on calls
    the dispatch gives to the Hopper family; others run as usual)."""
    from cupy_flash import _checks, _traits
    from cupy_flash.families import sm90
    from cupy_flash.forward import forward_plan

    def forward(q, k, v, causal=False):
        q, k, v, shape, scale, variant = _checks.prepare_qkv(q, k, v, None, causal)
        wide = (sm90.FORWARD_SM90_V_BLOCK,) if shape.tile > _traits.WIDE_TILE else ()
        return forward_plan(q, k, v, shape, scale, variant, (config[0], shape.tile, config[1], config[2]) + wide).run(q, k, v)
    return forward


def error_ok(tile, forward=cupy_flash.flash_forward):
    rng = numpy.random.default_rng(0)
    q, k, v = (cupy.asarray(rng.standard_normal((2, 333, 3, tile), dtype=numpy.float32).astype(ml_dtypes.bfloat16))
               for _ in range(3))
    for causal in (False, True):
        o, _ = forward(q, k, v, causal=causal)
        exact, _ = cupy_flash.attention_reference(q, k, v, causal=causal)
        low, _ = cupy_flash.attention_reference(q, k, v, causal=causal, upcast=False)
        ours = cupy.asarray(o.get().astype(numpy.float64))
        if float(abs(ours - exact).max()) > 2 * float(abs(low - exact).max()) + 1e-5:
            return False
    return True


def parse_candidates(args):
    candidates = {}
    for arg in args:
        tile, config = arg.split(":")
        candidates.setdefault(int(tile), []).append(tuple(int(x) for x in config.split(",")))
    return candidates


def peer_shapes(torch, backend, tile):
    """{(seqlen, causal): (input sets, the peer's TFLOP/s)} for the sweep's shapes at head dim ``tile``."""
    heads = 2048 // tile
    shapes = {}
    for n in SEQLENS:
        sets = make_sets(16384 // n, n, heads, tile, ml_dtypes.bfloat16, 3)
        for c in (0, 1):
            ms = time_calls(torch_peer(torch, backend, "fwd", bool(c)), torch_sets(torch, sets, backend, "fwd", bool(c)))
            shapes[(n, c)] = (sets, flops(16384 // n, heads, n, tile, c, "fwd") / ms / 1e9)
    return shapes


def sweep_sm90(candidates):
    import torch
    from torch.nn.attention import SDPBackend

    print("| d | block_m, block_n, stages | correct | " + " | ".join(f"N={n} c={c}" for n in SEQLENS for c in (0, 1)) + " |")
    print("|---|---|---|" + "---|" * (2 * len(SEQLENS)))
    for tile, configs in candidates.items():
        heads = 2048 // tile
        # cuDNN, or where it takes no such head dim (512) SDPA's memory-efficient backend
        try:
            shapes = peer_shapes(torch, SDPBackend.CUDNN_ATTENTION, tile)
        except RuntimeError:
            print(f"(d = {tile}: cuDNN refuses it; the peer is SDPA's memory-efficient backend)")
            shapes = peer_shapes(torch, SDPBackend.EFFICIENT_ATTENTION, tile)
        for config in configs:
            forward = sm90_forward(config)
            ok = error_ok(tile, forward)
            cells = []
            for (n, c), (sets, peer_tf) in shapes.items():
                ms = time_calls(lambda s: forward(s[0], s[1], s[2], causal=bool(c)), sets)
                ours_tf = flops(16384 // n, heads, n, tile, c, "fwd") / ms / 1e9
                cells.append(f"{ours_tf:.0f} ({ours_tf / peer_tf:.2f})")
            print(f"| {tile} | {config} | {ok} | " + " | ".join(cells) + " |", flush=True)
        del shapes
        cupy.get_default_memory_pool().free_all_blocks()
    print("TFLOP/s, bf16 forward (ratio to cuDNN, PyTorch SDPA's CUDNN_ATTENTION, in the same run)")


def main(argv=None):
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if {"-h", "--help"} & set(argv):
        print(__doc__)
        return 0
    try:
        import torch  # noqa: F401 - the peer
    except ImportError as error:
        raise SystemExit(f"python -m bench.tile_sweep needs PyTorch, its peer ({error})") from None
    from cupy_flash._device import require_gpu

    require_gpu("python -m bench.tile_sweep")
    if argv and argv[0] == "--sm90":
        return sweep_sm90(parse_candidates(argv[1:]) or SM90_CANDIDATES)

    import torch
    from torch.nn.attention import SDPBackend

    print("| d | block_n, warps, m_tiles | correct | " + " | ".join(f"N={n} c={c}" for n in SEQLENS for c in (0, 1)) + " |")
    print("|---|---|---|" + "---|" * (2 * len(SEQLENS)))
    for tile, configs in (parse_candidates(argv) or CANDIDATES).items():
        heads = 2048 // tile
        shapes = peer_shapes(torch, SDPBackend.FLASH_ATTENTION, tile)
        original = {name: table[tile] for name, table in tensor_core.FORWARD_TC_TARGETS.items()}
        for config in configs:
            use(tile, config)
            ok = error_ok(tile)
            cells = []
            for (n, c), (sets, flash_tf) in shapes.items():
                ms = time_calls(ours("fwd", bool(c)), sets)
                ours_tf = flops(16384 // n, heads, n, tile, c, "fwd") / ms / 1e9
                cells.append(f"{ours_tf:.0f} ({ours_tf / flash_tf:.2f})")
            print(f"| {tile} | {config} | {ok} | " + " | ".join(cells) + " |", flush=True)
        use(tile, original)
        del shapes
        cupy.get_default_memory_pool().free_all_blocks()
    print("TFLOP/s, bf16 forward (ratio to PyTorch's flash backend in the same run)")


if __name__ == "__main__":
    main()
