"""Quick device sanity check: every dtype, a few awkward shapes, forward and backward against the
float64 reference. Prints one line per case; exit status 1 on any failure."""

# ruff: noqa: E402 - the imports follow the help guard, which must run first

from bench import help_first

help_first("smoke", __doc__)

import sys

import cupy
import ml_dtypes
import numpy

import cupy_flash as cf

DTYPES = {"float16": numpy.float16, "bfloat16": ml_dtypes.bfloat16, "float32": numpy.float32}

def make(shape, dtype, rng):
    return cupy.asarray(rng.standard_normal(shape, dtype=numpy.float32).astype(dtype))

def maxerr(a, b):
    return float(numpy.abs(cupy.asnumpy(a).astype(numpy.float64) - cupy.asnumpy(b)).max())

def main():
    rng = numpy.random.default_rng(0)
    bad = 0
    cases = [(2, 1, 1, 3, 64, False), (2, 77, 130, 3, 40, True), (1, 300, 200, 2, 128, True),
             (1, 129, 129, 2, 256, False), (3, 65, 33, 2, 8, True), (1, 200, 513, 1, 96, True)]
    for name, dtype in DTYPES.items():
        for b, nq, nk, h, d, causal in cases:
            q, k, v, do = (make(s, dtype, rng) for s in [(b, nq, h, d), (b, nk, h, d), (b, nk, h, d), (b, nq, h, d)])
            o, lse = cf.flash_forward(q, k, v, causal=causal)
            ro, rlse = cf.attention_reference(q, k, v, causal=causal)
            lo, _ = cf.attention_reference(q, k, v, causal=causal, upcast=False)
            eo, elow = maxerr(o, ro), float(cupy.abs(lo - ro).max())
            fin = cupy.isfinite(rlse)
            else_ = float(cupy.abs(cupy.where(fin, lse - rlse, 0)).max())
            lse_ok = bool((cupy.isfinite(lse) == fin).all())
            dq, dk, dv = cf.flash_backward(do, q, k, v, o, lse, causal=causal)
            dq2, dk2, dv2 = cf.flash_backward(do, q, k, v, o, lse, causal=causal, deterministic=True)
            rg = cf.attention_reference_backward(do, q, k, v, causal=causal)
            lg = cf.attention_reference_backward(do, q, k, v, causal=causal, upcast=False)
            errs = [maxerr(g, r) for g, r in zip((dq, dk, dv), rg)]
            errs2 = [maxerr(g, r) for g, r in zip((dq2, dk2, dv2), rg)]
            lows = [float(cupy.abs(l - r).max()) for l, r in zip(lg, rg)]
            ok = lse_ok and eo <= 2 * elow + 1e-5 and all(e <= 2 * l + 1e-5 * (1 + float(cupy.abs(r).max()))
                                                          for e, l, r in zip(errs + errs2, lows + lows, rg + rg))
            bad += not ok
            print(f"{name:8s} b{b} nq{nq} nk{nk} h{h} d{d} c{int(causal)} o {eo:.2e}/{elow:.2e} lse {else_:.1e} "
                  f"grads {' '.join(f'{e:.1e}' for e in errs)} det {' '.join(f'{e:.1e}' for e in errs2)} "
                  f"low {' '.join(f'{e:.1e}' for e in lows)} {'OK' if ok else 'FAIL'}", flush=True)
    print("failures:", bad)
    return 1 if bad else 0

if __name__ == "__main__":
    sys.exit(main())
