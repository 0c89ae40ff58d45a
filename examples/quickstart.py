"""Quick start: attention forward and backward on random bfloat16 inputs, checked against the
float64 dense reference. Run after installing:  python examples/quickstart.py
Prints the max errors; exits 1 if no GPU is usable or an error is out of bounds."""

import argparse
import sys

import ml_dtypes
import numpy

from cupy_flash._device import require_gpu

argparse.ArgumentParser(description=__doc__).parse_args()   # --help, without a GPU
require_gpu("quickstart")   # one line and exit status 1 where there is none (no driver, an old one, no GPU)

import cupy  # noqa: E402

import cupy_flash  # noqa: E402

batch, seqlen, heads, head_dim = 2, 1000, 8, 128
rng = numpy.random.default_rng(0)


def random_bf16(*shape):
    return cupy.asarray(rng.standard_normal(shape, dtype=numpy.float32).astype(ml_dtypes.bfloat16))


q, k, v, do = (random_bf16(batch, seqlen, heads, head_dim) for _ in range(4))

o, lse = cupy_flash.flash_forward(q, k, v, causal=True)
dq, dk, dv = cupy_flash.flash_backward(do, q, k, v, o, lse, causal=True)

o_ref, _ = cupy_flash.attention_reference(q, k, v, causal=True)        # float64, dense
grads_ref = cupy_flash.attention_reference_backward(do, q, k, v, causal=True)


def max_error(ours, ref):
    return float(abs(cupy.asarray(ours.get().astype(numpy.float64)) - ref).max())


errors = {"o": max_error(o, o_ref)}
errors.update({name: max_error(g, r) for name, g, r in zip(("dq", "dk", "dv"), (dq, dk, dv), grads_ref)})
print(f"{cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}: bfloat16 "
      f"(batch={batch}, seqlen={seqlen}, heads={heads}, head_dim={head_dim}), causal")
for name, err in errors.items():
    print(f"  max |{name} - reference| = {err:.2e}")
# bfloat16 keeps 8 significant bits: errors of a few 1e-3 on O(1) values are rounding.
sys.exit(0 if max(errors.values()) < 5e-2 else 1)
