"""Bandwidth of the backward's preprocessing kernel (delta = rowsum(dO * O), lse_log2, zeroing the
float32 dQ accumulator) against this device's copy rate, both timed with CUDA events.

    python -m bench.preprocess_rate      # from the repository's root
"""

from __future__ import annotations

import cupy
import ml_dtypes
import numpy

from bench.attention import time_calls
from cupy_flash import _checks, _traits
from cupy_flash._params import make_params
from cupy_flash.families.rows import launch_preprocess


def main():
    batch, seqlen, heads, head_dim = 4, 16384, 16, 128   # 1 GiB of O + dO in bf16
    dtype = ml_dtypes.bfloat16
    rng = numpy.random.default_rng(0)
    o, do = (cupy.asarray(rng.standard_normal((batch, seqlen, heads, head_dim), dtype=numpy.float32)).astype(dtype)
             for _ in range(2))
    lse = cupy.zeros((batch, heads, seqlen), dtype=cupy.float32)
    shape = _checks.AttentionShape(batch, seqlen, seqlen, heads, head_dim, "bfloat16")
    padded = -(-seqlen // _traits.ROW_STAT_PADDING) * _traits.ROW_STAT_PADDING
    delta = cupy.zeros((batch * heads, padded), dtype=cupy.float32)
    lse_log2 = cupy.zeros((batch * heads, padded), dtype=cupy.float32)
    dq_accum = cupy.empty(o.shape, dtype=cupy.float32)
    params = make_params(shape, 1.0, delta_stride=padded, o=o, dout=do, lse=lse, delta=delta,
                         lse_log2=lse_log2, dq_accum=dq_accum)
    ms = time_calls(lambda _: launch_preprocess(params, shape), [None])
    moved = o.nbytes + do.nbytes + dq_accum.nbytes + lse.nbytes + delta.nbytes + lse_log2.nbytes

    source = cupy.empty(1 << 30, dtype=cupy.uint8)
    target = cupy.empty_like(source)
    copy_ms = time_calls(lambda _: target.__setitem__(Ellipsis, source), [None])
    copy_rate = 2 * source.nbytes / copy_ms / 1e6   # read + write, GB/s
    rate = moved / ms / 1e6
    print(f"preprocess: {moved / 1e9:.2f} GB moved in {ms:.3f} ms = {rate:.0f} GB/s; "
          f"device copy {copy_rate:.0f} GB/s (read + write); ratio {rate / copy_rate:.2f}")


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(prog="python -m bench.preprocess_rate", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    from cupy_flash._device import require_gpu

    require_gpu("python -m bench.preprocess_rate")
    main()
