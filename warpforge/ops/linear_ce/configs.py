"""Settings for linear + cross-entropy: arch -> LinearCECfg (see ops/_tiles.py).

chunk_elements is the number of logits materialised per chunk (rows × vocab): larger chunks make fewer, larger
GEMMs and fewer fp32 d_weight accumulations, for more memory (1 << 26 is 128 MB of bf16 logits).
`warpforge tune lce` sweeps it; the sm90 entry's measurements are in benchmarks/NOTES.md.
"""
from typing import NamedTuple

from .._tiles import TileTable


class LinearCECfg(NamedTuple):
    chunk_elements: int = 1 << 26
    block: int = 4096  # vocabulary columns per step of the softmax kernel's walk along a row


LINEAR_CE = TileTable({"cpu": {"any": LinearCECfg()}, "default": {"any": LinearCECfg()},
                       "sm90": {"any": LinearCECfg(chunk_elements=1 << 28)}})
