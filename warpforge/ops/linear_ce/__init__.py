"""Linear + cross-entropy without the logits: `linear_cross_entropy`."""
from .api import ce_chunk_rows, linear_cross_entropy
from .reference import linear_cross_entropy_reference

__all__ = ["linear_cross_entropy", "linear_cross_entropy_reference", "ce_chunk_rows"]
