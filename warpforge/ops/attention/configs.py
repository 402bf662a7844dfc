"""Tiles for the attention kernels: arch -> padded head dim (of the wider of q/k and v, at least 16) ->
AttentionTiles, one KernelCfg per pass (see ops/_tiles.py).

"cpu" is the Triton interpreter: small tiles so that CI's small shapes still cross block boundaries. sm90
entries come from `warpforge tune attention` on an H200 (benchmarks/NOTES.md); "default" serves any other
arch, safe rather than fast. sm90 loads through TMA only at d 64 / 128, the dims tuned and verified there.
"""
from typing import NamedTuple

from .._tiles import TileTable


class KernelCfg(NamedTuple):
    block_m: int    # query rows per tile
    block_n: int    # key rows per tile
    warps: int
    stages: int
    tma: bool = False        # load the walked operand (K/V, or Q/dO in the dk/dv pass) through TMA descriptors
    atomic_dq: bool = False  # backward: dq by fp32 atomics inside the dk/dv pass (no second pass)
    ws: bool = False         # forward, batched, d 64/128: the warp-specialized kernel (flash_ws_kernel.py; 4 warps)


class AttentionTiles(NamedTuple):
    fwd: KernelCfg
    dkdv: KernelCfg  # a program owns block_n keys and walks block_m queries per step
    dq: KernelCfg    # a program owns block_m queries and walks block_n keys per step


C, T = KernelCfg, AttentionTiles
# fp32 inputs (matmuls in full fp32 precision): tiles sized for 4-byte elements, correct rather than fast
_FP32 = {("fp32", d): T(C(64 if d <= 64 else 32, 32 if d <= 128 else 16, 4, 2 if d <= 128 else 1),
                          C(32 if d <= 128 else 16, 32 if d <= 128 else 16, 4, 1),
                          C(32 if d <= 128 else 16, 32 if d <= 128 else 16, 4, 1)) for d in (16, 32, 64, 128, 256)}
_PLAIN = T(C(64, 64, 4, 2), C(32, 64, 4, 2), C(64, 32, 4, 2))

TILES = TileTable({
    "cpu": {"any": T(C(16, 16, 1, 1), C(16, 16, 1, 1), C(16, 16, 1, 1))},
    "default": {**{d: _PLAIN for d in (16, 32, 64, 128)}, 256: T(C(32, 32, 4, 1), C(16, 32, 4, 1), C(32, 16, 4, 1)),
                **_FP32},
    "sm90": {
        16: T(C(64, 64, 4, 3), C(32, 64, 4, 2), C(128, 64, 8, 3)),
        32: T(C(64, 64, 4, 3), C(32, 64, 4, 2), C(128, 64, 8, 3)),
        64: T(C(128, 64, 4, 3, tma=True), C(32, 64, 4, 3, tma=True), C(64, 64, 4, 3, tma=True)),
        128: T(C(128, 128, 8, 3, tma=True), C(64, 64, 4, 2, tma=True), C(128, 64, 8, 3, tma=True)),
        256: T(C(64, 64, 4, 2), C(32, 64, 4, 2), C(64, 32, 4, 2)),
        **_FP32,
    },
})

# FP8 attention forward (fp8_kernel.py), by padded head dim (of the wider of q/k and v, at least 32). sm90: the
# largest tiles that compile without spills on sm_90 (Triton 3.6, scripts/compile_sm90.py; 128 x 128 spills at d128),
# not yet timed on the H200.
FP8_TILES = TileTable({
    "cpu": {"any": C(16, 16, 1, 1)},
    "default": {"any": C(64, 64, 4, 2), 256: C(64, 32, 4, 1)},
    "sm90": {32: C(128, 64, 8, 3), 64: C(128, 64, 8, 3), 128: C(128, 64, 8, 3), 256: C(64, 64, 8, 2)},
})

# The Hopper Gluon forward (flash_gluon_kernel.py; api.gluon_gate decides): gate constants and its tiles.
GLUON_ENV = "WARPFORGE_ATTN_GLUON"      # "1" on, "0" off (the portable kernel then runs), unset: GLUON_DEFAULT
GLUON_DEFAULT = True                    # on: 35 GPU tests pass; 1.15x cuDNN at b4 h16 s8192 d128 causal (runs/2026-12-02-s10)
GLUON_TRITON_VERSIONS = ("3.6",)        # Triton releases whose Gluon API the kernel was written and checked on
GLUON_HEAD_DIMS = (64, 128)
# (head dim, causal) -> (BLOCK_N, STAGES, PINGPONG, PERSISTENT); 128 query rows per work item (two 64-row consumer
# warpgroups). Compiled without spills for sm_90 (Triton 3.6); not yet timed on the H200 (benchmarks/NOTES.md,
# session 10): the persistent schedule (one program per SM, Q double-buffered) is off until measured.
GLUON_FWD = {
    (64, False): (128, 4, True, False), (64, True): (128, 4, True, False),
    (128, False): (128, 2, True, False), (128, True): (128, 2, True, False),
}

# The Hopper Gluon backward (flash_gluon_bwd_kernel.py; api.gluon_bwd_gate decides): its own switch, off until the H200
# has run its GPU tests and the fwd+bwd bench (scripts/bench_attention_gluon.py --bwd). Not used when deterministic=True
# (dq is summed by fp32 atomics): that stays on the portable backward.
GLUON_BWD_ENV = "WARPFORGE_ATTN_GLUON_BWD"  # "1" on, "0" off, unset: GLUON_BWD_DEFAULT
GLUON_BWD_DEFAULT = True                    # on (sm_90, Triton 3.6): faster than the portable backward on every case
# (head dim, causal) -> (BLOCK_M query rows per ring slot, STAGES ring slots, DQ_N dq columns per wgmma chunk, DQ_SPLIT,
# DQ_TMA); 128 keys per program (two 64-key consumer warpgroups). DQ_SPLIT: each warpgroup computes half of dQ's columns
# over both warpgroups' dS (half the fp32 reduction traffic, a barrier pair between the warpgroups per tile); it
# compiled with ~100-260 B of spills at d 128 until session 15 rebuilt the loop's wgmma descriptors at use (none now).
# DQ_TMA: dQ staged in shared memory and added by one TMA reduce-add per tile (cp.reduce.async.bulk.tensor, FA3's way)
# instead of per-thread fp32 atomics. The H200 sweep of session 11 (benchmarks/runs/2026-12-02-s11/call3/bwd_sweep.log,
# fwd+bwd vs cuDNN in one process): d128 split + TMA at 3 stages 0.984x at b4 h16 s8192 causal (the old per-thread
# atomics 0.723x, the portable bwd 0.826x), 0.879x at b32 s1024; d64 TMA alone 0.937x at b8 h32 s4096 (split + TMA
# 0.879x).
GLUON_BWD = {
    (64, False): (64, 4, 64, False, True), (64, True): (64, 4, 64, False, True),
    (128, False): (64, 3, 64, True, True), (128, True): (64, 3, 64, True, True),
}
# GQA in the Gluon backward, head dim -> programs per (kv head, 128-key block), each walking GROUP / GROUP_SPLIT query
# heads; dK / dV of the split programs are summed in fp32 by TMA reduce-adds (env WARPFORGE_ATTN_GLUON_BWD_GROUP_SPLIT;
# 0 = one query head per program, 1 = the whole group in one program). Why: a program over the whole group re-reads 8
# heads' Q / dO / dQ (64 MB per kv head at s 8192, d 128) across its lifetime, which does not stay in the 50 MB L2
# (benchmarks/NOTES.md, "Attention GQA and window (session 11)"). H200, GQA 8:1 b4 h32 s8192 d128 causal fwd+bwd, same
# process as cuDNN (session 12): split 1 0.818x, 2 0.880x, 4 0.896x, 8 0.959x. d 64: its GPU test passed (session 13), not
# yet timed against no split.
GLUON_BWD_GROUP_SPLIT = {128: 0, 64: 1}
# The backward's program order (ops/_gluon_flash_bwd._program): kv-head slices in groups of this many, key tile by key
# tile (env WARPFORGE_ATTN_GLUON_BWD_HEAD_GROUP). 1: slice after slice. A scheduling model (NOTES session 27) puts the
# causal cases' tail at 1.03-1.06x the ideal time in that order and ~1.00x in groups of 2; not yet timed.
GLUON_BWD_HEAD_GROUP = 1
# KEY_ROWS (ops/_gluon_flash_bwd.py): S, dP, P and dS computed transposed, keys as the wgmma's rows, so that Pᵀ and dSᵀ
# are the register A operands of dV and dK (no P tile through shared memory, dPᵀ issued beside Sᵀ and computed during
# the exp2s: FA3's order); where the knobs take it (BLOCK_M 64, DQ_SPLIT, DQ_TMA: d 128). Env
# WARPFORGE_ATTN_GLUON_BWD_KEY_ROWS: 0 off, 1 dK issued before dQ, 2 after (dQ's staging store beside dK). Measured
# fwd+bwd in one process (H100, runs/2026-12-06-s28/call1, 0 / 1 / 2): b4 h16 s8192 7.650 / 7.683 / 7.442 ms (0.955x /
# 0.950x / 0.981x cuDNN), b32 s1024 1.595 / 1.543 / 1.543, GQA 8:1 15.533 / 15.469 / 14.914; not yet on the H200.
GLUON_BWD_KEY_ROWS = 2

# Sliding windows (a left window; right 0 = causal, or unbounded) in both Gluon kernels; "0" sends them to the portable
# kernels. On: the window GPU tests pass on the H200, and b2 h16 s16384 d128 window 4096 fwd+bwd is 1.157x Flex against
# the portable kernels' 1.059x (session 12, same process); 1.28x since the backward stopped spilling (session 15).
GLUON_WINDOW_ENV = "WARPFORGE_ATTN_GLUON_WINDOW"
GLUON_WINDOW_DEFAULT = True
