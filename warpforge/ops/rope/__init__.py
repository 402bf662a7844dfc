"""Rotary position embedding: `apply_rope` and its angle tables."""
from .api import apply_rope
from .reference import rope_reference, rope_tables

__all__ = ["apply_rope", "rope_tables", "rope_reference"]
