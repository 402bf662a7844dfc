"""Tiles for Evoformer attention: arch -> padded head dim -> EvoformerTiles (see ops/_tiles.py).

"cpu" is the Triton interpreter. sm90 at d 8-16: the H200 sweep of session 11
(benchmarks/runs/2026-12-02-s11/call2/tune_evoformer.log, `warpforge tune evoformer`); d 32: session 31's H100 sweeps
(benchmarks/NOTES.md "Session 31": dk/dv with keys as rows, register caps on the forward and dq; the H200 has not
timed these yet); d 64 is still a first guess.
"""
import os
from typing import NamedTuple, Optional

from .._tiles import TileTable


class EvoCfg(NamedTuple):
    block_m: int   # query residues per tile
    block_n: int   # key residues per step
    warps: int
    stages: int
    key_rows: bool = False  # dk/dv pass: the step transposed, keys as rows (evoformer_kernel._walk_queries)
    maxnreg: Optional[int] = None  # a register cap: more programs an SM (the forward's is latency-bound)


class EvoformerTiles(NamedTuple):
    fwd: EvoCfg
    dkdv: EvoCfg   # a program owns block_n keys and walks block_m queries per step
    dq: EvoCfg     # a program owns block_m queries and walks block_n keys per step
    dbias: EvoCfg  # a program owns a [block_m, block_n] tile of the pair bias and walks the MSA rows
    fused: Optional[EvoCfg] = None  # the one-walk dk/dv/dq backward (bwd_fused()); None: dkdv's tile


C, T = EvoCfg, EvoformerTiles
TILES = TileTable({
    "cpu": {"any": T(C(16, 16, 1, 1), C(16, 16, 1, 1), C(16, 16, 1, 1), C(16, 16, 1, 1))},
    "default": {"any": T(C(64, 64, 4, 2), C(64, 64, 4, 2), C(64, 64, 4, 2), C(64, 64, 4, 2))},
    "sm90": {"any": T(C(64, 64, 4, 3), C(64, 64, 2, 2), C(64, 32, 4, 3), C(64, 32, 4, 3)),
             16: T(C(128, 32, 4, 3), C(64, 64, 2, 2), C(128, 32, 4, 3), C(64, 32, 4, 3)),   # d8 / d16: extra-MSA
             32: T(C(128, 32, 4, 3, maxnreg=128), C(32, 64, 4, 3, True), C(128, 32, 4, 3, maxnreg=120), C(64, 32, 4, 3),
                 C(64, 64, 4, 2)),  # fused: wgmma
             64: T(C(64, 64, 4, 3), C(64, 64, 4, 2), C(64, 64, 4, 2), C(64, 64, 4, 2))},  # 128-row fwd spills at d64
})

# The backward's dk/dv and dq in one walk over the scores (evoformer_kernel.evo_bwd_fused_kernel) instead of two
# passes: "1" on. Off until the H200 has timed it (benchmarks/NOTES.md, "Evoformer (session 11)").
BWD_FUSED_ENV = "WARPFORGE_EVO_BWD_FUSED"
BWD_FUSED_DEFAULT = False


def _switch(env: str, default: bool) -> bool:
    flag = os.environ.get(env)
    return default if flag is None else flag != "0"


def bwd_fused() -> bool:
    return _switch(BWD_FUSED_ENV, BWD_FUSED_DEFAULT)


# The Hopper Gluon kernels on sm_90: the forward (fwd_gluon_kernel), the backward's dk/dv (dkdv_gluon_kernel) and its
# dq and pair-bias gradient in one pass (dq_dbias_gluon_kernel, instead of the dq and pair-bias passes); "0" turns
# one off, "1" on. Session 32 (H100, benchmarks/NOTES.md): the dq + pair-bias pass beats the two passes it replaces
# (0.818 vs 0.997 ms at the row shape, 0.324 vs 0.499 triangle): on; the forward and dk/dv kernels are slower than
# the portable ones (0.760 vs 0.498, 0.910 vs 0.724 ms: latency-bound at one program an SM): off.
GLUON_FWD_ENV = "WARPFORGE_EVO_GLUON_FWD"
GLUON_DKDV_ENV = "WARPFORGE_EVO_GLUON_DKDV"
GLUON_ENV = "WARPFORGE_EVO_GLUON"
GLUON_FWD_DEFAULT = False
GLUON_DKDV_DEFAULT = False
GLUON_DEFAULT = True


def gluon_fwd() -> bool:
    return _switch(GLUON_FWD_ENV, GLUON_FWD_DEFAULT)


def gluon_dkdv() -> bool:
    return _switch(GLUON_DKDV_ENV, GLUON_DKDV_DEFAULT)


def gluon_dq_dbias() -> bool:
    return _switch(GLUON_ENV, GLUON_DEFAULT)
