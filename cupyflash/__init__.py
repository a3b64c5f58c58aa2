"""cupyflash: exact, fused, O(N)-memory FlashAttention for CuPy arrays.

The public functions take CuPy arrays (GPU kernels) or NumPy arrays (the same
blocked algorithm on the CPU) and return the attention output ``o`` with its
softmax statistics ``m`` (row max) and ``l`` (row exp-sum).
"""

from . import reference
from ._compile import precompile
from .api import (dropout_mask, flash_attention, flash_attention_backward, flash_attention_forward,
                  flash_attention_varlen_backward, flash_attention_varlen_forward)

__version__ = "0.1.0"
__all__ = ["flash_attention", "flash_attention_forward", "flash_attention_backward", "flash_attention_varlen_forward",
           "flash_attention_varlen_backward", "dropout_mask", "precompile", "reference", "__version__"]
