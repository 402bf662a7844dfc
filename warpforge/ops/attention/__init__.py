"""Dense attention: `flash_attention` (FlashAttention's interface) and its reference."""
from .api import MAX_HEAD_DIM, flash_attention
from .reference import attention_reference, attention_varlen_reference

__all__ = ["flash_attention", "attention_reference", "attention_varlen_reference", "MAX_HEAD_DIM"]
