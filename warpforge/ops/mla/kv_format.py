"""The latent cache formats: one record per format that the reference, the validation, the tile table and the
kernel launch all read.

A cache row holds one token's 576-wide latent (512 "nope" values, V being those same 512, then 64 rope
values). Byte layouts:
- "bf16":  576 values in q's dtype (bf16 or fp16).
- "fp8":   656 bytes = 512 e4m3 + 4 fp32 scales (one per 128 latent values, powers of two) + 64 bf16 rope.
- "nvfp4": 416 bytes = 256 bytes of e2m1 pairs (low nibble = even element) + 32 e4m3 scales (one per 16)
           + 64 bf16 rope; values are e2m1 · scale · kv_scale, kv_scale one fp32 for the whole cache.
- "mxfp4": 400 bytes = 256 bytes of e2m1 pairs + 16 e8m0 scales (one per 32, 2^(byte - 127)) + 64 bf16 rope.
"""
from __future__ import annotations

from typing import NamedTuple

D_QK, D_V, D_ROPE = 576, 512, 64


class KVFormat(NamedTuple):
    name: str
    code: int            # the kernel's KV_FMT constant
    width: int           # elements per cache row (the cache tensor's last dim)
    group: int           # latent values per scale (0: no scales)
    scale_offset: int    # offset of the scales in a row, in the cache's elements (bytes when quantized)
    scale_bytes: int     # bytes per scale: fp32 4, e4m3 / e8m0 1
    rope_offset: int     # offset of the 64 rope values (bf16 when quantized), in the cache's elements
    tensor_scale: bool   # values also carry one fp32 scale for the whole cache (kv_scale)

    @property
    def quantized(self) -> bool:
        return self.code != 0

    @property
    def row_bytes(self) -> int:
        return 2 * D_QK if self.code == 0 else self.width


def _quantized(name, code, data_bytes, group, scale_bytes, tensor_scale=False):
    scales = D_V // group * scale_bytes
    return KVFormat(name, code, data_bytes + scales + 2 * D_ROPE, group, data_bytes, scale_bytes,
                    data_bytes + scales, tensor_scale)


KV_FORMATS = {
    "bf16": KVFormat("bf16", 0, D_QK, 0, 0, 0, D_V, False),
    "fp8": _quantized("fp8", 1, D_V, 128, 4),
    "nvfp4": _quantized("nvfp4", 2, D_V // 2, 16, 1, tensor_scale=True),
    "mxfp4": _quantized("mxfp4", 3, D_V // 2, 32, 1),
}
