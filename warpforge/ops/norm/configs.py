"""Launch settings for the norm kernels: arch -> kind -> row width -> NormCfg (see ops/_tiles.py). Kinds:
"rms_fwd", "rms_bwd", "layer_fwd", "layer_bwd" (add_rms_norm runs the rms kernels); an arch row without a kind falls
back to its "any"."""
from typing import NamedTuple

from .._tiles import TileTable


class NormCfg(NamedTuple):
    warps: int
    programs_per_sm: int = 4  # backward: persistent programs per multiprocessor, each walking a run of rows
    block_rows: int = 1       # rows per tile (forward program, backward step); a power of two
    prefetch: bool = True     # backward: load the next tile before working on this one (norm_bwd_kernel)


N = NormCfg
# a row per program: one warp holds up to 256 columns, wider rows spread over more warps
_BY_WIDTH = {0: N(1), 257: N(4), 2049: N(8)}

# H200 (`warpforge tune norm`, graph-replayed, benchmarks/NOTES.md "Norms, session 10"). Widths 513-1024 are the
# 768 measurements, 2049-4096 the 4096 ones. Forward: the sweep's winners (16k x 768: (2, -, 2) 13.0 us rms, 14.3 us
# layer; 16k x 4096: (2, -, 1) 66.3 us, near the copy rate). Backward: tiles of 32 fp32 columns a thread per tensor
# (4 warps x 4 rows of 1024 at 768, 8 warps x 1 row of 4096), as many programs per SM as their registers allow
# (ptxas for sm_90: 170 and 116 a thread, so 2 and 2: 3 at 768 would need <= 168), chosen on CPU from the old
# kernel's winners ((1, 8, 2) rms and (4, 2, 4) layer at 768, (8, 2, 1) at 4096) for this kernel's accumulators
# and prefetch, not yet timed; the sweep replaces them.
_FWD_SM90 = {0: N(1), 257: N(4), 513: N(2, 4, 2), 1025: N(4), 2049: N(2, 4, 1), 4097: N(8)}
_BWD_SM90 = {0: N(1), 257: N(4), 513: N(4, 2, 4), 1025: N(4), 2049: N(8, 2, 1), 4097: N(8)}
NORM = TileTable({
    "cpu": {"any": _BY_WIDTH},
    "default": {"any": _BY_WIDTH},
    "sm90": {"rms_fwd": _FWD_SM90, "layer_fwd": _FWD_SM90, "rms_bwd": _BWD_SM90, "layer_bwd": _BWD_SM90},
})
