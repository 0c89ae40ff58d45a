"""How precisely Hopper's e4m3 tensor cores accumulate: torch._scaled_mm with use_fast_accum=True (the
wgmma chain alone, as the FP8 forward's S = Q K^T runs it, no promotion to float32 between steps)
against float64 sums of the same e4m3 products, 512 x 512 dot products per row of the table. Needs
PyTorch. A: sum of the products' magnitudes; partial: the running sums after each k32 step.

    python -m bench.fp8_accumulation
"""

# ruff: noqa: E402 - the imports follow the help guard, which must run first
from bench import help_first

help_first("fp8_accumulation", __doc__)

import torch

torch.manual_seed(0)
dev = "cuda"
print("| data | K | max err / A | max err / (steps x max|partial|) | mean signed err / A | max err / max|S| |")
print("|---|---|---|---|---|---|")
for data in ("normal", "positive", "outliers"):
    for K in (32, 64, 128, 256):
        M = N = 512
        a = torch.randn(M, K, device=dev)
        b = torch.randn(N, K, device=dev)
        if data == "positive":
            a, b = a.abs(), b.abs()
        if data == "outliers":
            a[torch.rand_like(a) < 1e-2] *= 20
            b[torch.rand_like(b) < 1e-2] *= 20
        a8 = (a / a.abs().max() * 448).to(torch.float8_e4m3fn)
        b8 = (b / b.abs().max() * 448).to(torch.float8_e4m3fn)
        one = torch.ones((), device=dev)
        s = torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.float32, use_fast_accum=True)
        a64, b64 = a8.to(torch.float64), b8.to(torch.float64)
        exact = a64 @ b64.t()
        A = a64.abs() @ b64.abs().t()
        prods = a64[:, None, :] * b64[None, :, :]
        partial = prods.reshape(M, N, K // 32, 32).sum(-1).cumsum(-1).abs().amax(-1)
        err = (s.double() - exact)
        e = err.abs()
        print(f"| {data} | {K} | {(e / A).max():.3e} (2^{torch.log2((e / A).max()):.1f}) | "
              f"{(e / (partial * (K // 32))).max():.3e} (2^{torch.log2((e / (partial * (K // 32))).max()):.1f}) | "
              f"{(err / A).mean():+.2e} | {(e.max() / exact.abs().max()):.2e} |", flush=True)
