"""Launch settings for the SwiGLU kernels: arch -> SwigluCfg (see ops/_tiles.py)."""
from typing import NamedTuple

from .._tiles import TileTable


class SwigluCfg(NamedTuple):
    block: int = 1024  # columns per program (a row of I columns takes cdiv(I, block) programs)


SWIGLU = TileTable({"cpu": {"any": SwigluCfg()}, "default": {"any": SwigluCfg()}})
