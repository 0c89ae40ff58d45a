"""Small forward + backward (atomic and deterministic) for every dtype, causal and not, on ragged
shapes: the workload compute-sanitizer's memcheck and racecheck run over."""

import cupy
import numpy

import cupy_flash

import ml_dtypes

rng = numpy.random.default_rng(0)
for dtype in (numpy.float16, ml_dtypes.bfloat16, numpy.float32):
    for causal in (False, True):
        for (nq, nk, d) in ((70, 45, 72), (33, 130, 256), (129, 129, 32)):
            q = cupy.asarray(rng.standard_normal((1, nq, 2, d), dtype=numpy.float32).astype(dtype))
            k = cupy.asarray(rng.standard_normal((1, nk, 2, d), dtype=numpy.float32).astype(dtype))
            v = cupy.asarray(rng.standard_normal((1, nk, 2, d), dtype=numpy.float32).astype(dtype))
            o, lse = cupy_flash.flash_forward(q, k, v, causal=causal)
            for deterministic in (False, True):
                cupy_flash.flash_backward(o, q, k, v, o, lse, causal=causal, deterministic=deterministic)
cupy.cuda.Device().synchronize()
print("sanitize workload done")
