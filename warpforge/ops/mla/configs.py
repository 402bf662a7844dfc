"""Tiles for MLA decode: arch -> cache format -> query rows per request (h_q · s_q, or h_q when sparse) ->
MLACfg (see ops/_tiles.py: a format without entries of its own takes "any"'s).

"cpu" is the Triton interpreter. sm90 entries come from `warpforge tune mla` on an H200 (benchmarks/NOTES.md):
bf16 runs fastest with the page ids loaded a step ahead (three tile buffers at h_q 16, whose 168 KB fill an SM:
one wave of programs); FP8 at h_q 16 with fp16 math, 32-token steps and the next step's bytes prefetched into
registers; FP4 with 32-token steps. "default" serves any other arch, safe rather than fast.
"""
from typing import NamedTuple

from .._tiles import TileTable


class MLACfg(NamedTuple):
    block_h: int   # query rows (h_q · s_q) per program
    block_n: int   # cache tokens per step
    warps: int
    stages: int
    fp16_math: bool = False  # quantized caches: dequantise to fp16 (not q's bf16) and run the latent dots in fp16
    prefetch: bool = False   # FP8, dense: load the next step's bytes into registers while this step computes
    index_ahead: bool = False  # load the next step's page ids / slots a step early (deeper tile pipelining)
    waves: int = 2  # programs per SM that the split count aims at (1 where one program's tiles fill the SM)


C = MLACfg
MANY_ROWS = 17  # from here a request's rows fill a larger tile
_FP32 = {0: C(16, 16, 4, 1), MANY_ROWS: C(32, 16, 4, 1)}  # fp32 q (full-precision matmuls): small tiles
DECODE = TileTable({
    "cpu": {"any": C(16, 16, 1, 1)},
    "default": {"any": {0: C(16, 32, 4, 2), MANY_ROWS: C(64, 32, 8, 2)}, "fp32": _FP32},
    "sm90": {"any": {0: C(16, 64, 4, 3, index_ahead=True, waves=1), MANY_ROWS: C(64, 64, 8, 2, index_ahead=True)},
             "fp32": _FP32,
             "fp8": {0: C(16, 32, 4, 3, fp16_math=True, prefetch=True), MANY_ROWS: C(64, 64, 8, 2)},
             # NVFP4 at <= 16 rows: fp16 math (its words decode to exact fp16 values, no fp32 round trip: loop SASS
             # 1931 -> 1499, session 43; not yet timed)
             "nvfp4": {0: C(16, 32, 4, 2, fp16_math=True), MANY_ROWS: C(64, 64, 8, 2)},
             "mxfp4": {0: C(16, 32, 4, 2), MANY_ROWS: C(64, 64, 8, 2)}},
})

class DequantCfg(NamedTuple):
    """The dequantisation pass of quantized caches onto bf16 scratch pages (dequant_kernel.py)."""
    pages: int  # 64-token scratch pages per program
    warps: int


# one page, 4 warps: `warpforge tune mla --dequant` on the H200 (session 18, b 128, h_q 128, L 8k) found it best for
# FP8 (~3.1 TB/s) and NVFP4, and MXFP4's best (1, 8) within noise of it (benchmarks/NOTES.md)
DEQUANT = TileTable({"cpu": {"any": DequantCfg(1, 1)}, "default": {"any": DequantCfg(1, 4)}})

# The Hopper Gluon kernel (decode_gluon_kernel.py; api.gluon_gate decides): its fixed tile and gate constants.
GLUON_ENV = "WARPFORGE_MLA_GLUON"       # "0" turns the Gluon path off (the portable kernel then runs everywhere)
GLUON_DEQUANT_ENV = "WARPFORGE_MLA_GLUON_DEQUANT"  # "0": quantized caches keep the portable kernel at 64+ rows
GLUON_IN_KERNEL_ENV = "WARPFORGE_MLA_GLUON_IN_KERNEL"  # "0": quantized caches of page 64 take the dequantised pages
#                                                        too (api.quantized_in_kernel decides otherwise)
GLUON_TRITON_VERSIONS = ("3.6",)        # Triton releases whose Gluon API the kernel was written and checked on
GLUON_BLOCK_H = 64                      # query rows per program
GLUON_MIN_ROWS = 64                     # h_q · s_q from which a request's rows fill its tile
GLUON_PAGE = 64                         # one cache page = one 64-token step
GLUON_WAVES = 1                         # one program fills an SM's shared memory: split for one wave

# The Gluon kernel for requests of at most 16 query rows over FP8 caches (decode_rows16_gluon_kernel.py; api.rows16_gate
# decides): one warpgroup, ~206 registers and ~109 KB of shared memory at 2 slots of 64 tokens, two programs an SM
# (benchmarks/NOTES.md, session 22)
GLUON_ROWS16_ENV = "WARPFORGE_MLA_GLUON_ROWS16"  # "0": those requests keep the portable kernel
GLUON_ROWS16_MAX_ROWS = 16
GLUON_ROWS16_STAGES = 2   # TMA ring slots of 64 tokens
GLUON_ROWS16_WAVES = 2    # programs per SM the split count aims at
