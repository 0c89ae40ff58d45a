"""cupy_flash: exact FlashAttention forward and backward as CUDA kernels compiled by CuPy at run time.

    o, lse = flash_forward(q, k, v, causal=True)
    dq, dk, dv = flash_backward(do, q, k, v, o, lse, causal=True)

See README.md and the docstrings of the functions below.
"""

from .backward import flash_backward
from .decode import flash_decode, merge_attention_states
from .forward import flash_attention, flash_forward
from .reference import attention_reference, attention_reference_backward, decode_reference

__version__ = "0.1.0"

__all__ = [
    "flash_forward",
    "flash_backward",
    "flash_attention",
    "flash_decode",
    "merge_attention_states",
    "attention_reference",
    "attention_reference_backward",
    "decode_reference",
    "__version__",
]
