"""Tiles for the MoE grouped GEMMs: arch -> model shape (E, 2I, H) of w13 -> token count -> MoECfg (see
ops/_tiles.py: "any" serves shapes without their own entries; the largest token threshold <= T is used).

"cpu" is the Triton interpreter (small tiles so that CI's small shapes cross block boundaries). sm90 entries
come from `warpforge tune moe` and `warpforge tune moe-wgrad` on an H200 (benchmarks/NOTES.md); "default"
serves any other arch, safe rather than fast.
"""
from typing import NamedTuple

from .._tiles import TileTable


class GemmTile(NamedTuple):
    block_n: int
    block_k: int
    warps: int
    stages: int


class MoECfg(NamedTuple):
    block_m: int    # slots per row block (align's block_m): small for decode, where weights dominate
    up: GemmTile    # gate/up GEMM (and the per-slot backward GEMM)
    down: GemmTile  # down GEMM with the scatter epilogue (and d_hidden)
    split_k: int = 1  # down GEMM only: K cut into this many ranges, summed by the scatter's atomics
    wgrad: GemmTile | None = None  # weight-gradient kernel (None: `up`'s tile)
    fp8_fp16_math: bool = False  # FP8 weights: dequantise to fp16 and run the MMA in fp16 (moe_kernel.fp16_math)
    # FP8 weights' own tiles at this entry (warpforge tune moe --w-format fp8), None: these. Their k is at most
    # 128 (one scale block) and the dequantisation changes what hides under the loads, so their best differs.
    fp8: "MoECfg | None" = None


C, G = MoECfg, GemmTile
WGRAD = G(128, 256, 8, 2)  # the weight-gradient kernel at training sizes (warpforge tune moe-wgrad)
_FP32 = {0: C(16, G(32, 64, 4, 2), G(32, 64, 4, 2))}  # fp32 activations (full-precision matmuls): small tiles
# untuned shapes on sm90: the patterns the tuned shapes share
_SM90_ANY = {0: C(16, G(32, 256, 4, 4), G(64, 128, 4, 3), 2), 16: C(16, G(32, 128, 4, 4), G(64, 128, 4, 3)),
             128: C(16, G(128, 128, 4, 3), G(64, 128, 4, 3)), 512: C(64, G(128, 64, 8, 3), G(128, 64, 8, 3)),
             2048: C(128, G(128, 64, 8, 4), G(256, 64, 8, 4), wgrad=WGRAD)}


def _fp8(block_m, up, down, split_k=1):
    """FP8 weights' tiles (warpforge tune moe --w-format fp8, session 14): fp16 math won at every entry tuned."""
    return C(block_m, up, down, split_k, fp8_fp16_math=True)


GEMMS = TileTable({
    "cpu": {"any": {0: C(16, G(32, 32, 1, 1), G(32, 32, 1, 1))}},
    "default": {"any": {0: C(16, G(64, 64, 4, 3), G(64, 64, 4, 3)), 256: C(64, G(64, 64, 4, 3), G(64, 64, 4, 3))},
                "fp32": _FP32},
    "sm90": {
        "fp32": _FP32,
        "any": _SM90_ANY,
        (8, 28672, 4096): {  # Mixtral-8x7B
            0: C(16, G(32, 256, 4, 5), G(128, 128, 4, 3), 4,
                 fp8=_fp8(16, G(128, 128, 4, 3), G(128, 128, 4, 4), 4)),
            16: C(16, G(32, 256, 4, 5), G(64, 128, 4, 5), 4, fp8=_fp8(16, G(128, 128, 4, 3), G(128, 128, 4, 5))),
            64: C(32, G(64, 128, 4, 3), G(128, 128, 4, 3)),
            128: C(64, G(64, 128, 4, 4), G(128, 128, 4, 4), fp8=_fp8(64, G(64, 64, 4, 4), G(128, 128, 4, 3))),
            # T 512: a row block per expert (uniform routing), each weight tile read once
            512: C(128, G(128, 64, 8, 4), G(128, 128, 8, 3)),
            2048: C(128, G(128, 64, 8, 4), G(256, 64, 8, 4), wgrad=WGRAD)},
        (128, 1536, 2048): {  # Qwen3-30B-A3B
            0: C(16, G(32, 256, 4, 3), G(128, 64, 4, 3), 2), 16: C(16, G(32, 128, 4, 4), G(64, 128, 4, 3)),
            128: C(16, G(128, 128, 4, 3), G(64, 128, 4, 3)),
            2048: C(128, G(128, 64, 8, 4), G(256, 64, 8, 4), wgrad=WGRAD)},
        (256, 4096, 7168): {  # DeepSeek-V3: the untuned bf16 tiles, tuned FP8 ones
            **_SM90_ANY,
            0: _SM90_ANY[0]._replace(fp8=_fp8(16, G(128, 128, 4, 4), G(64, 128, 4, 4))),
            16: _SM90_ANY[16]._replace(fp8=_fp8(16, G(128, 128, 4, 5), G(128, 128, 4, 3))),
            128: _SM90_ANY[128]._replace(fp8=_fp8(16, G(128, 128, 4, 3), G(128, 128, 4, 4)))},
    },
})


class DecodeTile(NamedTuple):
    """The one-launch decode kernel (decode_kernel.py): a program's I columns, its gate/up k step, its down GEMM's
    H step."""
    block_n: int
    block_k: int
    block_h: int
    warps: int
    stages: int
    fp8_fp16_math: bool = True  # FP8 weights: dequantised to fp16, the MMAs in fp16 (as the gathered path's FP8)
    fp8: bool = True  # FP8 weights take it too (False: they keep the gathered path)


# Inference takes the one-launch decode kernel where an entry has a tile (None: the gathered path). sm90: the tiles
# `warpforge tune moe-decode` chose on the H200 (session 16, bench cases, graph replay, ms vs the gathered path):
# Qwen3-30B-A3B T1 0.0362 vs 0.0444 (64 wide), T4 0.0883 vs 0.0909 (uniform routing); Mixtral T1 0.1840 vs
# 0.1847, FP8 0.1124 vs 0.1145 (128 wide); DeepSeek-V3 T1 0.1797 vs 0.1910, FP8 0.1161 vs 0.1223; from T 2 (T 5
# for Qwen3) the gathered path wins. On since session 17, whose GPU tests passed at T 1 / 4 / 16 with a counter per
# token (session 16's kernel summed wrongly at some T > 1 when one program converted several tokens' rows). T1
# only: at T4 the kernel reads an expert's weights once per slot, and with skewed routing (the bench's zipf case,
# tokens sharing experts) Qwen3 T4 took 0.0696 ms against the gathered path's 0.062 (session 17, call3). Other
# shapes: gathered.
# The interpreter runs it below T 4 (CI's decode shapes).
D = DecodeTile
DECODE = TileTable({
    "cpu": {"any": {0: D(16, 32, 32, 1, 1), 4: None}},
    "default": {"any": {0: None}},
    "sm90": {"any": {0: None},
             (8, 28672, 4096): {0: D(128, 128, 256, 4, 3), 2: None},  # Mixtral-8x7B
             (128, 1536, 2048): {0: D(64, 128, 256, 4, 4), 2: None},  # Qwen3-30B-A3B (T4: see above)
             # DeepSeek-V3's FP8 weights: gathered (session 17: 0.119-0.120 ms in three runs vs the kernel's 0.128)
             (256, 4096, 7168): {0: D(128, 128, 256, 4, 3, fp8=False), 2: None}},  # DeepSeek-V3
})
DECODE_TRY = DecodeTile(32, 128, 256, 4, 4)  # WARPFORGE_MOE_DECODE=1 where the table has no tile (the A/B's)


class SortedTile(NamedTuple):
    block_n: int
    block_k: int
    warps: int
    stages: int
    ws: bool = False  # tl.range(warp_specialize=True): takes effect over descriptor loads at warps 4 only


class SortedCfg(NamedTuple):
    """The training-size path (sorted_kernel.py): activations copied once into align's sorted order, so that
    every GEMM reads contiguous rows of one expert per row block through tensor descriptors, in persistent
    tile loops."""
    block_m: int        # align's block_m for this path
    up: SortedTile      # gate/up GEMM (one MMA over [gate | up] rows: the output tile is block_n wide, B's 2x)
    down: SortedTile    # down GEMM and the backward's d_hidden GEMM
    wgrad: SortedTile   # block_n x block_k tiles of dW, reduced over the expert's rows block_m at a time
    dact: SortedTile | None = None  # backward d act GEMM (None: up's tile); the SwiGLU gradient is a pass of its own
    on: bool = False    # the default path where the entry applies; WARPFORGE_MOE_SORTED=1 / 0 overrides


S, ST = SortedCfg, SortedTile
# Token thresholds: None below (decode and small prefill keep moe_kernel.py's gathered-row kernels). The sm90
# tiles are the Hopper probe's persistent-descriptor shapes (shared/HOPPER-PIPELINE.md), on for training since
# session 14 measured them past the gathered path at T 8192 fwd+bwd. The weight gradient is warp-specialized (4 warps,
# 2 stages): +5% / +10% / +5% fwd+bwd for Mixtral / DeepSeek-V3 / Qwen3 at T 8192, gradients right (session 15,
# `warpforge tune moe-sorted`). Down specialized: no consistent gain; gate/up cannot be (its accumulator split aborts
# Triton 3.6's specialization), and the launch refuses it (sorted_kernel._gemm; NOTES.md, sessions 15-16).
# d act 256 wide since it is a plain GEMM: 4.434 -> 3.632 ms with its SwiGLU-gradient pass (Mixtral, session 16).
_SM90_SORTED = S(128, ST(128, 64, 8, 3), ST(256, 64, 8, 3), ST(128, 256, 4, 2, ws=True), ST(256, 64, 8, 3), on=True)
SORTED = TileTable({
    "cpu": {"any": {0: None, 4096: S(16, ST(32, 32, 1, 1), ST(32, 32, 1, 1), ST(32, 32, 1, 1))}},
    "default": {"any": {0: None}},
    "sm90": {"fp32": {0: None}, "any": {0: None, 2048: _SM90_SORTED}},
})


class RoutingCfg(NamedTuple):
    # inference routing (route_kernel.py) and `align` (align_kernel.py, decode sizes) as one Triton launch each,
    # instead of ~25 small torch kernels; on per arch once their GPU tests have passed there
    one_launch: bool


ROUTING = TileTable({"cpu": {"any": RoutingCfg(True)}, "default": {"any": RoutingCfg(False)},
                     "sm90": {"any": RoutingCfg(True)}})
