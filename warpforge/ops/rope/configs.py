"""Launch settings for the rotary-embedding kernel: arch -> RopeCfg (see ops/_tiles.py)."""
from typing import NamedTuple

from .._tiles import TileTable


class RopeCfg(NamedTuple):
    max_block_h: int = 16  # heads rotated together per step of a position's program


ROPE = TileTable({"cpu": {"any": RopeCfg()}, "default": {"any": RopeCfg()}})
