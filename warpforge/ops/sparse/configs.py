"""Tiles for sparse attention: arch -> padded head dim (at least 16) -> SparseTiles (see ops/_tiles.py). Every tile
is clipped to the block size (a tile never crosses a block).

"cpu" is the Triton interpreter: small tiles so that CI's small blocks still hold several. sm90 entries start from
dense attention's; d 128's fwd and dq from `warpforge tune sparse` at 64k on an H200 (benchmarks/NOTES.md).
"""
from typing import NamedTuple

from .._tiles import TileTable


class KernelCfg(NamedTuple):
    block_m: int  # query rows per tile
    block_n: int  # key rows per tile
    warps: int
    stages: int
    tma: bool = False  # the walked operands through TMA descriptors (fwd / dq: K and V; dk/dv: q and do)
    atomic_dq: bool = False  # dk/dv: dq by fp32 atomics in this pass, no dq pass (faster if atomics are; not bitwise
                             # reproducible)


class SparseTiles(NamedTuple):
    fwd: KernelCfg
    dq: KernelCfg
    dkdv: KernelCfg   # a program owns block_n keys and walks block_m queries per step
    index: KernelCfg  # block scores (a program owns a whole query block) and the index loss's statistics


C, T = KernelCfg, SparseTiles
_FP32 = {("fp32", d): T(C(32, 32, 4, 1), C(32, 32, 4, 1), C(32, 32, 4, 1), C(32, 32, 4, 1))
         for d in (16, 32, 64, 128, 256)}
_PLAIN = T(C(64, 64, 4, 2), C(64, 32, 4, 2), C(32, 64, 4, 2), C(64, 64, 4, 2))
TILES = TileTable({
    "cpu": {"any": T(C(16, 16, 1, 1), C(16, 16, 1, 1), C(16, 16, 1, 1), C(16, 16, 1, 1))},
    "default": {"any": _PLAIN, 256: T(C(32, 32, 4, 1), C(32, 16, 4, 1), C(16, 32, 4, 1), C(32, 32, 4, 1)), **_FP32},
    "sm90": {"any": T(C(128, 64, 8, 3), C(64, 64, 4, 3), C(64, 64, 4, 3, tma=True), C(64, 64, 4, 2)),
             128: T(C(128, 128, 8, 3), C(128, 128, 8, 2), C(64, 64, 4, 2, tma=True), C(64, 64, 4, 2)),
             256: T(C(64, 32, 4, 2), C(64, 32, 4, 2), C(32, 32, 4, 1), C(32, 32, 4, 1)), **_FP32},
})

# The Hopper Gluon forward (ops/_gluon_flash_fwd.py, the sparse walk; api._gluon_fwd decides): batched 16-bit inputs,
# head dim 64 / 128 (d_v = d), blocks of a multiple of 128 rows, sm_90, a Triton in GLUON_TRITON_VERSIONS.
GLUON_ENV = "WARPFORGE_SPARSE_GLUON"   # "1" on, "0" off (the portable kernel runs), unset: GLUON_DEFAULT
GLUON_DEFAULT = True                   # on: its 10 GPU tests pass on the H200; fwd+bwd 1.12-1.23x Flex given the
                                       # indices at 16k-128k, the portable 0.99-1.02x (runs/2026-12-05-s25/call1)
GLUON_TRITON_VERSIONS = ("3.6",)
# head dim -> (BLOCK_N, STAGES, PINGPONG, PERSISTENT): dense attention's Gluon forward table (its causal entries)
GLUON_FWD = {64: (128, 4, True, False), 128: (128, 2, True, False)}
# The Hopper Gluon backward (ops/_gluon_flash_bwd.py, the sparse walk), same gate: head dim -> (BLOCK_M, STAGES, DQ_N,
# DQ_SPLIT, DQ_TMA, GROUP_SPLIT, HEAD_GROUP, KEY_ROWS): dense attention's table, and one query head per program
# (GROUP_SPLIT 0: dK / dV summed over the group by fp32 TMA reduce-adds, so a popular key block's walk is split GROUP
# ways). dQ (and dK / dV when split, or in query order) are sums in arrival order: not bitwise reproducible (GLUON_ENV=0
# keeps the deterministic portable pass). HEAD_GROUP: programs ordered key tile by key tile within groups of that many
# query heads, so the long walks of the first key blocks start early (scripts/sim_bwd_order.py: 1.10x the ideal time at
# 16k in head order, 1.01x in groups of 4; measured fwd+bwd at 16k 2.268 -> 2.138 ms, H100, runs/2026-12-06-s27/call3).
# Capped so that the group's Q, dO (16-bit) and dQ accumulator (fp32), 8 · d bytes a query a head, stay within
# GLUON_BWD_GROUP_BYTES: the measured win at 16k, d 128, groups of 4 holds 64 MB, the measured loss at 64k, groups of 4,
# 256 MB (9.09 -> 11.93 ms, same call), and head after head at 64k holds 64 MB. 32k gets groups of 2 by the rule (the
# model: 1.05x -> 1.01x), not yet timed. KEY_ROWS: the transposed step (attention/configs.GLUON_BWD_KEY_ROWS; where the
# knobs take it; 0 off, 1 / 2 dK issued before / after dQ): the kernels alone, fwd+bwd, H100 (runs/2026-12-06-s28): 16k
# 2.160 / 2.111 / 2.080 ms (0 / 1 / 2), 64k 9.262 -> 8.985 (0 / 2). d 64's knobs do not take it (no DQ_SPLIT).
GLUON_BWD = {64: (64, 4, 64, False, True, 0, 4, 0), 128: (64, 3, 64, True, True, 0, 4, 2)}
GLUON_BWD_GROUP_BYTES = 64 << 20
# The backward's programs: "key" (one a key block and query-head slice, key tile by key tile, above) or "query" (one
# a (query block, key block) pair over the GQA group's heads, a query block's pairs side by side: its Q, dO and dQ
# rows stay in L2 across its key blocks; each pair's dK / dV reduce-added in fp32 (in arrival order: not bitwise
# reproducible, MHA included); 128-row blocks; GROUP_SPLIT as in the knobs, 0 read as 1). Query order where
# one head's Q, dO and dQ accumulator (8 · d bytes a query) exceed GLUON_BWD_QUERY_ORDER_BYTES: key order reads them
# once per key block that kept them, from anywhere in the sequence, and past L2's ~50 MB that was 5% / 21% / 38% at
# 64k / 128k / 256k (session 26). Measured (H100, the kernels alone, fwd+bwd, one call, each order its own process,
# runs/2026-12-06-s29/call6): 64k 8.83 -> 8.80 ms (the pairs' dK / dV epilogues cost what locality gains), 128k
# 21.7-22.1 -> 17.6-18.3 ms. Session 30 (H100, three calls, each order twice a call: runs/2026-12-06-s30/call2, 3, 5)
# read 64k at 8.93-9.07 ms in key order against 8.69-8.85 in query order (each call's first timing; -2%), so from 64k
# (d 128; 32k untimed). On the H200 (runs/2026-12-06-s30/call7, the same way): 64k even, 128k -2%; 1M in the family
# bench 193 ms in key order (session 29) and 151 in query order (session 30): two runs, Flex 206 / 197 in each.
# WARPFORGE_SPARSE_GLUON_BWD_ORDER ("key" / "query") overrides.
GLUON_BWD_QUERY_ORDER_BYTES = 48 << 20
GLUON_BWD_ORDER_ENV = "WARPFORGE_SPARSE_GLUON_BWD_ORDER"
