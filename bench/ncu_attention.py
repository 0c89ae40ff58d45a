"""One call of ours and one of a PyTorch SDPA peer on the same data, for Nsight Compute to profile
side by side (each runs three times: the profiler's --launch-skip passes the warm-up calls):

    ncu --clock-control none --kernel-name regex:"flash_|fmha|sdpa|cudnn" --launch-skip 4 --launch-count 2 \\
        --section SpeedOfLight --section WarpStateStats --section InstructionStats \\
        python -m bench.ncu_attention --mode fwd --peer cudnn --head-dim 128 --seqlen 8192

--mode fwd: flash_forward against the peer's forward; --mode bwd: flash_backward against the
peer's backward (--deterministic 1: ours with deterministic=True). --peer flash (FlashAttention-2 in
PyTorch) or cudnn. --lineinfo builds our kernels with line information, for ncu's source page
(`--set full --import-source yes`, then `ncu -i REP --page source --csv --print-source sass`):
stall samples per SASS instruction.
"""

from __future__ import annotations

import argparse

import cupy

import cupy_flash
from bench.attention import DTYPES, make_sets, to_torch


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", default="bwd", choices=["fwd", "bwd"])
    parser.add_argument("--peer", default="flash", choices=["flash", "cudnn"])
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--causal", type=int, default=0, choices=[0, 1])
    parser.add_argument("--deterministic", type=int, default=0, choices=[0, 1])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--features", type=int, default=2048)
    parser.add_argument("--lineinfo", action="store_true", help="compile our kernels with -lineinfo")
    args = parser.parse_args()
    if args.lineinfo:   # before the first kernel compiles (the option is part of the cache key)
        from cupy_flash import _compile

        _compile.OPTIONS = _compile.OPTIONS + ("-lineinfo",)

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[args.peer]
    batch, heads = max(1, args.tokens // args.seqlen), args.features // args.head_dim
    q, k, v, do = make_sets(batch, args.seqlen, heads, args.head_dim, DTYPES[args.dtype], 1)[0]
    causal = bool(args.causal)
    o, lse = cupy_flash.flash_forward(q, k, v, causal=causal)
    tq, tk, tv, tdo = (to_torch(torch, x).transpose(1, 2) for x in (q, k, v, do))
    tq, tk, tv = (x.detach().requires_grad_() for x in (tq, tk, tv))
    with sdpa_kernel(backend):
        out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
    for _ in range(3):
        if args.mode == "fwd":
            cupy_flash.flash_forward(q, k, v, causal=causal)
            with torch.no_grad(), sdpa_kernel(backend):
                torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
        else:
            cupy_flash.flash_backward(do, q, k, v, o, lse, causal=causal, deterministic=bool(args.deterministic))
            torch.autograd.grad(out, (tq, tk, tv), tdo, retain_graph=True)
    cupy.cuda.Device().synchronize()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
