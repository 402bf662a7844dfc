"""Fused Mixture-of-Experts: `fused_moe` (vLLM/SGLang's call), its pieces `route`, `align`, `experts`, and FP8
expert weights (`quantize_weights`)."""
from .align import align
from .api import check_routing, experts, fused_moe, quantize_weights, route
from .reference import (dequantize_weights_reference, experts_reference, fused_moe_reference,
                        quantize_weights_reference, route_reference)

__all__ = ["fused_moe", "experts", "route", "align", "quantize_weights", "check_routing", "fused_moe_reference",
           "route_reference", "experts_reference", "dequantize_weights_reference", "quantize_weights_reference"]
