"""Launch settings for the norm kernels: arch -> kind -> row width -> NormCfg (see ops/_tiles.py). Kinds:
"rms_fwd", "rms_bwd", "layer_fwd", "layer_bwd", "add_fwd", "add_bwd" (add_rms_norm's, an fp32 stream plus a bf16
branch as the GPT runs it); an arch row without a kind falls back to its "any"."""
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

# H200 (`warpforge tune norm`, graph-replayed; benchmarks/NOTES.md "Norms, session 10"). Widths 513-1024 are the
# 768 measurements, 2049-4096 the 4096 ones. Forward: the sweep's winners (16k x 768: (2, -, 2) 13.0 us rms, 15.0 us
# layer; 16k x 4096: (2, -, 1) 66.3 us, near the copy rate). Backward at 768: (4, 4, 2) with prefetch, 26.3 us rms
# and 27.8 us layer (runs/2026-12-02-s10/callB; the old kernel's best: 36.5 and 49.2). At 4096: (8, 2, 1), the old
# kernel's winner (129.7 us there), not yet swept with this kernel.
_FWD_SM90 = {0: N(1), 257: N(4), 513: N(2, 4, 2), 1025: N(4), 2049: N(2, 4, 1), 4097: N(8)}
_BWD_SM90 = {0: N(1), 257: N(4), 513: N(4, 4, 2), 1025: N(4), 2049: N(8, 2, 1), 4097: N(8)}
# add_rms_norm's backward (an fp32 residual stream: x and d_sum in fp32, two dx stores) takes more registers: 164 at
# (4, -, 2) x 768 and 184 at (8, -, 1) x 4096 (ptxas, sm_90), so 3 and 1 programs per SM reside, not 4 and 2 (more
# would run a second, partial wave). The 768 entries are the session 11 sweep's winners (runs/2026-12-02-s11/call5:
# bwd (4, 3, 2) 54.5 us, fwd (2, 4, 2) 38.3 us); 4096 not yet timed.
_ADD_BWD_SM90 = {0: N(1), 257: N(4), 513: N(4, 3, 2), 1025: N(4), 2049: N(8, 1, 1), 4097: N(8)}
NORM = TileTable({
    "cpu": {"any": _BY_WIDTH},
    "default": {"any": _BY_WIDTH},
    "sm90": {"rms_fwd": _FWD_SM90, "layer_fwd": _FWD_SM90, "add_fwd": _FWD_SM90, "rms_bwd": _BWD_SM90,
             "layer_bwd": _BWD_SM90, "add_bwd": _ADD_BWD_SM90},
})
