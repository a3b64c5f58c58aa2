"""cupyflash: exact, fused, O(N)-memory FlashAttention for CuPy arrays.

The public functions take CuPy arrays (GPU kernels) or NumPy arrays (the same
blocked algorithm on the CPU) and return the attention output ``o`` with its
softmax statistics ``m`` (row max) and ``l`` (row exp-sum).
"""

from . import reference
from ._compile import precompile
from .merge import merge_attention, merge_attention_stacked
from .api import (ForwardResult, dropout_mask, flash_attention, flash_attention_backward, flash_attention_forward,
                  flash_attention_varlen_backward, flash_attention_varlen_forward)
from .kvcache import flash_attention_with_kvcache
from .float8 import flash_attention_forward_fp8
from .blockmask import BlockMask, block_mask
from . import distributed

__version__ = "0.1.0"
__all__ = ["flash_attention", "flash_attention_forward", "flash_attention_backward", "flash_attention_varlen_forward",
           "flash_attention_varlen_backward", "ForwardResult", "flash_attention_with_kvcache", "merge_attention",
           "merge_attention_stacked", "flash_attention_forward_fp8", "dropout_mask", "block_mask", "BlockMask", "precompile", "reference",
           "distributed", "__version__"]
