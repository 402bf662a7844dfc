"""Trainable top-k block-sparse attention (MiniMax Sparse Attention style): `sparse_attention`, `select_blocks`,
`sparse_attention_index_loss` and their references."""
from .api import select_blocks, sparse_attention, sparse_attention_index_loss
from .reference import (index_block_scores_reference, index_loss_reference, sparse_attention_full_reference,
                        sparse_attention_reference, sparse_attention_varlen_reference)

__all__ = ["sparse_attention", "select_blocks", "sparse_attention_index_loss", "sparse_attention_reference",
           "sparse_attention_varlen_reference", "sparse_attention_full_reference", "index_block_scores_reference",
           "index_loss_reference"]
