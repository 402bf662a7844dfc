"""The paged KV cache formats: what a [num_pages, page_size, h_kv, width] cache holds per token and head.

- "bf16" / "fp16" / "fp32": the values, in q's dtype (width d).
- "fp8": e4m3 values (torch.float8_e4m3fn, width d), dequantised as value · scale with k_scale / v_scale either
  per tensor (a float or one-element fp32 tensor, as vLLM passes them) or per page and head (fp32 [num_pages,
  h_kv]).
- "nvfp4": uint8 rows of d/2 bytes of packed e2m1 (low nibble = even element) then d/16 e4m3 block scales, times
  one fp32 tensor scale (k_scale / v_scale, required); width d/2 + d/16.
- "mxfp4": uint8 rows of d/2 bytes of e2m1 then d/32 e8m0 (power-of-two) block scales; width d/2 + d/32.
An FP4 cache may instead be a pair of tensors, FlashInfer's layout (its kv_cache_sf): the packed values
[num_pages, page_size, h_kv, d/2] and the block scales [num_pages, page_size, h_kv, d/block] apart (quantize_kv(...,
split_scales=True)). Its 64-byte value rows (at d 128) take 16-byte copies, where a 72-byte row is only 8-byte aligned.
Values and block scales are quant.py's; the portable kernel decodes them with shared_kernels.e2m1_words_to_halves
(32-bit words, where the rows are 4-byte aligned) or e2m1_to_float.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ... import quant


@dataclass(frozen=True)
class PagedKVFormat:
    name: str
    code: int                      # the kernel's KV_FMT: 0 values, 1 fp8, 2 nvfp4, 3 mxfp4
    storage: Optional[torch.dtype]  # the cache's dtype (None: q's)
    group: int = 0                 # FP4 values per block scale

    @property
    def quantized(self) -> bool:
        return self.code != 0

    @property
    def fp4(self) -> bool:
        return self.group > 0

    def width(self, d: int) -> int:
        """The cache's last dim for head dim d."""
        return d // 2 + d // self.group if self.fp4 else d

    def scale_width(self, d: int) -> int:
        """FP4: block scales per token and head for head dim d."""
        return d // self.group

    def head_dim(self, width: int) -> int:
        """The head dim a cache of this last dim holds (the inverse of width)."""
        return width * 2 * self.group // (self.group + 2) if self.fp4 else width


KV_FORMATS = {
    "bf16": PagedKVFormat("bf16", 0, torch.bfloat16),
    "fp16": PagedKVFormat("fp16", 0, torch.float16),
    "fp32": PagedKVFormat("fp32", 0, torch.float32),
    "fp8": PagedKVFormat("fp8", 1, torch.float8_e4m3fn),
    "nvfp4": PagedKVFormat("nvfp4", 2, torch.uint8, quant.FP4_GROUP["nvfp4"]),
    "mxfp4": PagedKVFormat("mxfp4", 3, torch.uint8, quant.FP4_GROUP["mxfp4"]),
}
BY_DTYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float8_e4m3fn: "fp8"}


def split_fp4(cache, d: int):
    """(packed values [.., d/2], block scales [.., d/block]) of an FP4 cache: the pair itself, or views of a cache
    in the row layout (values then scales in each row)."""
    if isinstance(cache, (tuple, list)):
        return cache[0], cache[1]
    return cache[..., :d // 2], cache[..., d // 2:]
