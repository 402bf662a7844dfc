"""RMSNorm / LayerNorm: `rms_norm`, `add_rms_norm` (residual add + norm in one pass), `layer_norm`."""
from .api import add_rms_norm, layer_norm, rms_norm
from .reference import add_rms_norm_reference, layer_norm_reference, rms_norm_reference

__all__ = ["rms_norm", "add_rms_norm", "layer_norm", "rms_norm_reference", "add_rms_norm_reference",
           "layer_norm_reference"]
