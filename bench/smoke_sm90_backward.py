"""The experimental Hopper backward (kernels_cu/backward_sm90.cu) against the float64 reference and the
portable backward, on a few shapes; prints err / low-precision err per gradient (the 3x rule).

    CUPY_FLASH_KERNELS=experimental timeout 120 python bench/smoke_sm90_backward.py
"""

# ruff: noqa: E402 - the imports follow the help guard, which must run first

from bench import help_first

help_first("smoke_sm90_backward", __doc__)

import cupy
import ml_dtypes
import numpy

import cupy_flash
from cupy_flash import families

rng = numpy.random.default_rng(2)

def array(shape, dtype=ml_dtypes.bfloat16):
    return cupy.asarray(rng.standard_normal(shape, dtype=numpy.float32).astype(dtype))

SHAPES = ((2, 1000, 1000, 4, 2), (1, 333, 777, 3, 3), (1, 777, 333, 2, 1), (1, 2048, 2048, 8, 8))   # b, nq, nk, h, h_kv
worst = 0.0
for d in (64, 128, 96, 256, 192):
    for causal in (False, True):
        for batch, nq, nk, heads, heads_kv in SHAPES:
            q, do = array((batch, nq, heads, d)), array((batch, nq, heads, d))
            k, v = array((batch, nk, heads_kv, d)), array((batch, nk, heads_kv, d))
            o, lse = cupy_flash.flash_forward(q, k, v, causal=causal)
            grads = cupy_flash.flash_backward(do, q, k, v, o, lse, causal=causal)
            exact = cupy_flash.attention_reference_backward(do, q, k, v, causal=causal)
            low = cupy_flash.attention_reference_backward(do, q, k, v, causal=causal, upcast=False)
            ratios = []
            for g, e, lo in zip(grads, exact, low):
                err = float(abs(g.astype(cupy.float64) - e).max())
                ratios.append(err / (float(abs(lo.astype(cupy.float64) - e).max()) + 1e-5))
            worst = max(worst, *ratios)
            print(f"d={d} causal={causal} {(batch, nq, nk, heads, heads_kv)} dq/dk/dv err/low "
                  + " ".join(f"{r:.2f}" for r in ratios), flush=True)
device = families.current_device()
print("WORST", round(worst, 3), "setting", families.kernels_setting(), "compute capability", device.compute_capability)
