"""MLA decode (absorbed Multi-head Latent Attention over a paged latent cache): `plan` / `MLAPlan.run`,
`mla_decode`, the cache formats and `quantize_kv`."""
from .api import MAX_H_Q, PAGE_SIZES, MLAPlan, mla_decode, plan, quantize_kv
from .kv_format import D_QK, D_ROPE, D_V, KV_FORMATS, KVFormat
from .reference import dequantize_kv_reference, mla_decode_reference, nvfp4_tensor_scale, quantize_kv_reference

__all__ = ["mla_decode", "plan", "MLAPlan", "quantize_kv", "nvfp4_tensor_scale", "KV_FORMATS", "KVFormat", "MAX_H_Q",
           "PAGE_SIZES", "D_QK", "D_V", "D_ROPE", "mla_decode_reference", "dequantize_kv_reference",
           "quantize_kv_reference"]
