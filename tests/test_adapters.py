"""CPU: the JAX and PyTorch adapters are imported only when used, and the JAX adapter's trace-time
checks raise flash_forward's own errors (the GPU suite compares them with an eager call's)."""

import subprocess
import sys
import types

import ml_dtypes
import numpy
import pytest

from cupy_flash._checks import check_traced_call


def test_importing_cupy_flash_imports_neither_jax_nor_torch():
    code = ("import sys, cupy_flash, cupy_flash.distributed; "
            "print(sorted(m for m in ('jax', 'torch', 'jaxlib') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout


def _traced(shape, dtype=numpy.float16):
    return types.SimpleNamespace(shape=shape, dtype=dtype)   # what a JAX tracer shows: shape and dtype


@pytest.mark.parametrize("q, k, options, error, message", [
    ((1, 16, 2, 64), (1, 16, 2, 72), {}, ValueError, "k has head_dim 72 but q has head_dim 64"),
    ((1, 16, 3, 64), (1, 16, 2, 64), {}, ValueError, "k has 2 heads but q has 3"),
    ((1, 16, 2, 520), (1, 16, 2, 520), {}, ValueError, "q has head_dim 520; expected 1 to 512"),   # (60: padded)
    ((16, 2, 64), (16, 2, 64), {}, ValueError, "q must have 4 dimensions"),
    ((1, 16, 2, 64), (1, 16, 2, 64), dict(window_size=(-2, 0)), ValueError, "window_size left is -2"),
    ((1, 16, 2, 64), (1, 16, 2, 64), dict(causal="yes"), TypeError, "causal"),
    ((1, 16, 2, 64), (1, 16, 2, 64), dict(sink=[0.0, 0.0]), TypeError, "unsupported option(s) ['sink']"),
])
def test_traced_checks_name_the_argument(q, k, options, error, message):
    with pytest.raises(error) as raised:
        check_traced_call("flash_attention (JAX)", _traced(q), _traced(k), _traced(k), options)
    assert message in str(raised.value)


def test_traced_checks_take_bfloat16_and_return_hashable_options():
    q = _traced((2, 33, 4, 64), numpy.dtype(ml_dtypes.bfloat16))
    k = _traced((2, 40, 2, 64), numpy.dtype(ml_dtypes.bfloat16))
    static = check_traced_call("flash_attention (JAX)", q, k, k, dict(causal=True, window_size=[8, 0], softcap=5))
    assert dict(static) == dict(softmax_scale=0.125, causal=True, window_size=(8, 0), softcap=5.0, deterministic=False)
    hash(static)
    with pytest.raises(TypeError, match="v has dtype float16 but q has dtype bfloat16"):
        check_traced_call("flash_attention (JAX)", q, k, _traced((2, 40, 2, 64)), {})
