"""Tiles for Evoformer attention: arch -> padded head dim -> EvoformerTiles (see ops/_tiles.py).

"cpu" is the Triton interpreter. sm90 entries are first guesses (small head dims: the score work, not the
matmuls, dominates), compiled for sm_90 without spills (scripts/compile_sm90.py), not yet timed on the H200.
"""
from typing import NamedTuple

from .._tiles import TileTable


class EvoCfg(NamedTuple):
    block_m: int   # query residues per tile
    block_n: int   # key residues per step
    warps: int
    stages: int


class EvoformerTiles(NamedTuple):
    fwd: EvoCfg
    dkdv: EvoCfg   # a program owns block_n keys and walks block_m queries per step
    dq: EvoCfg     # a program owns block_m queries and walks block_n keys per step
    dbias: EvoCfg  # a program owns a [block_m, block_n] tile of the pair bias and walks the MSA rows


C, T = EvoCfg, EvoformerTiles
TILES = TileTable({
    "cpu": {"any": T(C(16, 16, 1, 1), C(16, 16, 1, 1), C(16, 16, 1, 1), C(16, 16, 1, 1))},
    "default": {"any": T(C(64, 64, 4, 2), C(64, 64, 4, 2), C(64, 64, 4, 2), C(64, 64, 4, 2))},
    "sm90": {"any": T(C(128, 64, 4, 3), C(64, 64, 4, 2), C(64, 64, 4, 2), C(64, 64, 4, 2)),
             64: T(C(64, 64, 4, 3), C(64, 64, 4, 2), C(64, 64, 4, 2), C(64, 64, 4, 2))},  # 128-row fwd spills at d64
})
