"""Launch settings for the norm kernels: arch -> row width -> NormCfg (see ops/_tiles.py)."""
from typing import NamedTuple

from .._tiles import TileTable


class NormCfg(NamedTuple):
    warps: int
    programs_per_sm: int = 4  # backward: persistent programs per multiprocessor, each walking a run of rows
    block_rows: int = 1       # rows per tile (forward program, backward step); a power of two


# a row per program: one warp holds up to 256 columns, wider rows spread over more warps
_BY_WIDTH = {"any": {0: NormCfg(1), 257: NormCfg(4), 2049: NormCfg(8)}}
NORM = TileTable({"cpu": _BY_WIDTH, "default": _BY_WIDTH})
