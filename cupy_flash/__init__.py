"""cupy_flash: exact FlashAttention forward and backward as CUDA kernels compiled by CuPy at run time.

    o, lse = flash_forward(q, k, v, causal=True)
    dq, dk, dv = flash_backward(do, q, k, v, o, lse, causal=True)
    o, pullback = flash_vjp(q, k, v, causal=True); dq, dk, dv = pullback(do)

Every function takes ``stream=`` (a CuPy or PyTorch stream, or a cudaStream_t); by default kernels
run on CuPy's current stream.

See README.md, docs/api.md and the docstrings of the functions below.
"""

from .backward import flash_backward
from .decode import flash_decode, merge_attention_states
from .forward import flash_attention, flash_forward
from .fp8 import quantize_fp8
from .reference import attention_reference, attention_reference_backward, decode_reference
from .vjp import flash_vjp

__version__ = "0.1.0"

__all__ = [
    "flash_forward",
    "flash_backward",
    "flash_attention",
    "flash_vjp",
    "flash_decode",
    "merge_attention_states",
    "attention_reference",
    "attention_reference_backward",
    "decode_reference",
    "quantize_fp8",
    "__version__",
]
