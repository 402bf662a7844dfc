"""Tiles for paged GQA decode: arch -> cache format -> padded head dim -> PagedCfg (see ops/_tiles.py).

"cpu" is the Triton interpreter. sm90 d <= 128 entries come from `warpforge tune paged` on the H200
(benchmarks/NOTES.md: two stages beat three, the page ids loaded ahead did not pay here, fp16 math pays for fp8,
the register prefetch for FP4); the d 256 entries are first guesses checked to compile on sm_90; "default" serves
any other arch, safe rather than fast.
"""
from typing import NamedTuple

from .._tiles import TileTable


class PagedCfg(NamedTuple):
    block_h: int   # query rows (GQA group · s_q, padded to at least 16) per program: an upper bound
    block_n: int   # cache tokens per step
    warps: int
    stages: int
    index_ahead: bool = False  # load the next step's page ids a step early, so the pipeliner can run the K/V copies
    #                            stages - 1 steps ahead (MLA decode's measurement: benchmarks/NOTES.md)
    waves: int = 2  # programs per SM that the split count aims at
    fp16_math: bool = False  # fp8 / nvfp4 caches under bf16 q: dots in fp16 (e4m3 -> fp16 is one conversion per
    #                          pair; -> bf16 adds one per element), q and the probabilities rounded to fp16 (finer
    #                          than bf16; their values, ≤ 448 and ≤ 6 · 448, fit; mxfp4's power-of-two scales may not)
    prefetch: bool = False  # load the next step's raw bytes into registers while this step computes
    fp8_mma: int = 0  # fp8 caches: 1 = the e4m3 codes straight into fp8 tensor-core dots (q per row and the
    #                   probabilities per row and step rounded to e4m3 with fp32 scales; no dequantisation in the
    #                   loop, the loads feed dots); 2 = the same with q and p each a pair of e4m3 (value + its
    #                   rounding error: two dots each, ~7 mantissa bits); 0 = dequantise in registers
    fp8_tokens_m: bool = False  # fp8_mma's dots transposed (Sᵀ = K·qᵀ, Oᵀ = Vᵀ·Pᵀ): the cache tokens are the MMA's
    #                             M, so sm_90's wgmma (M >= 64; Triton runs fp8 dots only there) pads no query rows
    gluon: bool = False  # the Hopper Gluon kernel (decode_gluon_kernel.py): block_n = 4 warps' tokens per step,
    #                      stages = its cp.async ring's slots; block_h, warps and the knobs above do not apply
    q_shared: bool = False  # the Gluon kernel: q's mma fragments loaded from shared memory at each step's score
    #                         dot instead of held in 32 registers (the NVFP4 pair: 182 -> 168 registers, three
    #                         programs an SM; benchmarks/NOTES.md, session 43); off until a GPU times it


C = PagedCfg
# block_h 64: up to a GQA group of 8 times s_q 8 in one program (each K/V byte read once per split); more rows
# (s_q up to 16: GQA 8 · 16 = 128) take several row tiles, each reading the split's K/V. Head dims that are not
# powers of two run in the next power of two's tiles (masked columns): 80 and 96 take the d <= 128 entries, 192
# the d 256 ones
DECODE = TileTable({
    "cpu": {"any": C(16, 16, 1, 1)},
    "default": {"any": {0: C(64, 32, 4, 2), 256: C(32, 32, 4, 1)}, "fp32": C(16, 16, 4, 1)},
    "sm90": {"any": {0: C(64, 64, 4, 2), 256: C(64, 32, 4, 2)}, "fp32": C(16, 16, 4, 1),
             # fp8: fp16 dots; 2 splits beat the planner's 1 at b64 h_kv 8 (waves 8 plans them)
             "fp8": {0: C(64, 128, 4, 2, waves=8, fp16_math=True), 256: C(64, 32, 4, 2)},
             # FP4 at d 256: 16-token steps gave wrong results on the H200 (Triton 3.6; right in the interpreter,
             # benchmarks/NOTES.md), 32-token steps right; "default" takes 32 at d 256 too. d <= 128: the next
             # step's bytes prefetched (6.43 -> 3.14 ms at L 16k)
             "nvfp4": {0: C(64, 32, 4, 2, waves=8, prefetch=True), 256: C(64, 32, 4, 2)},
             "mxfp4": {0: C(64, 32, 4, 2, waves=8, prefetch=True), 256: C(64, 32, 4, 2)}},
})


# The Gluon kernel (decode_gluon_kernel.py), where api.gluon_gate holds: sm_90 and a Triton in GLUON_TRITON_VERSIONS,
# an fp8 / nvfp4 / mxfp4 cache (mxfp4 under bf16 q), d 128, GQA group · s_q <= 16, no softcap or window; FP4 values
# and block scales in packed rows, FP8 rows 16-byte aligned (else the portable kernel, decided per call:
# decode_gluon_kernel.cache_ok).
# WARPFORGE_PAGED_GLUON=0 turns it off.
GLUON_ENV = "WARPFORGE_PAGED_GLUON"
# An NVFP4 cache as the pair (values, block scales apart) takes the portable kernel unless this is "1": the Gluon
# kernel on the pair gave a wrong output (~1e-37) when replayed from a CUDA graph in the family bench's order on an
# H100 (session 42, benchmarks/NOTES.md; tests/paged/test_paged_gluon.py reproduces it with this set), though eager
# calls were bitwise the rows'. Off until that is understood; the row layout and MXFP4's pair are unaffected.
GLUON_NVFP4_PAIR_ENV = "WARPFORGE_PAGED_GLUON_NVFP4_PAIR"
GLUON_TRITON_VERSIONS = ("3.6",)   # the kernel module's copy; tests check they agree
# 128-token steps, one split at b64 h_kv 8; FP8 3 slots, FP4 2 (sessions 19-20's sweeps: benchmarks/NOTES.md)
GLUON = {"fp8": C(16, 128, 4, 3, waves=2, gluon=True),
         **dict.fromkeys(("nvfp4", "mxfp4"), C(16, 128, 4, 2, waves=2, gluon=True))}


class AppendCfg(NamedTuple):
    block_t: int   # tokens per program (of one kv head)
    warps: int


# append_kv_slots: a copy with a little arithmetic per element (FP4: two candidate exponents per block);
# first guesses, checked to compile on sm_90 without spills
APPEND = TileTable({
    "cpu": {"any": AppendCfg(16, 1)},
    "default": {"any": AppendCfg(16, 4)},
})
