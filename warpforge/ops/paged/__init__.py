"""Paged GQA decode: `paged_decode` (plan/run like FlashInfer's), the cache formats, `quantize_kv`, `append_kv`
and `append_kv_slots` (vLLM's reshape_and_cache)."""
from .api import (HEAD_DIMS, MAX_S_Q, PAGE_SIZES, PagedPlan, append_kv, append_kv_slots, head_dims, paged_decode,
                  plan, quantize_kv)
from .kv_format import KV_FORMATS, PagedKVFormat
from .reference import (append_kv_slots_reference, dequantize_kv_reference, paged_decode_reference,
                        quantize_kv_reference)

__all__ = ["paged_decode", "plan", "PagedPlan", "quantize_kv", "append_kv", "append_kv_slots", "head_dims",
           "KV_FORMATS", "PagedKVFormat", "PAGE_SIZES", "HEAD_DIMS", "MAX_S_Q", "paged_decode_reference",
           "quantize_kv_reference", "dequantize_kv_reference", "append_kv_slots_reference"]
