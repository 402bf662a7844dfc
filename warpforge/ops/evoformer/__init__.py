"""Evoformer attention (AlphaFold's MSA row / column and triangle attention with pair bias):
`evoformer_attention`, DS4Sci_EvoformerAttention's call, and its reference."""
from .api import MAX_HEAD_DIM, evoformer_attention
from .reference import evoformer_attention_reference

__all__ = ["evoformer_attention", "evoformer_attention_reference", "MAX_HEAD_DIM"]
