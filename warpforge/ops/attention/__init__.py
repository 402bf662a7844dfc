"""Dense attention: `flash_attention` (FlashAttention's interface), `flash_attention_fp8` (FP8 / INT8-QK forward)
and their references."""
from .api import MAX_HEAD_DIM, flash_attention
from .fp8_api import flash_attention_fp8, flash_attention_quantized, quantize_qkv
from .fp8_quantize import QuantizedQKV
from .reference import attention_reference, attention_varlen_reference

__all__ = ["flash_attention", "flash_attention_fp8", "flash_attention_quantized", "quantize_qkv", "QuantizedQKV",
           "attention_reference", "attention_varlen_reference", "MAX_HEAD_DIM"]
