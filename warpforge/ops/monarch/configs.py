"""Tiles for the Monarch kernels: arch -> kind ("fp32" for fp32 operands, else "any") -> MonarchCfg (see
ops/_tiles.py).

`gemm` serves the four block-diagonal GEMMs (two forward, dx chain); `wgrad` the per-block weight gradients over
tokens. Tile edges are shrunk to the block's dimensions at launch (a power of two, at least 16). "cpu" is the
Triton interpreter: tiles of 16 so that CI's small blocks (12, 24, 40 columns) cross tile edges, descriptor loads
on for fp16 so the interpreter runs that path too. The sm90 row comes from `warpforge tune monarch` on the H200
(benchmarks/NOTES.md: 128x256x64 tiles, 8 warps, 3 stages won the GEMM sweep; 128x128x64 the weight gradients);
fp32 operands take smaller tiles (their shared-memory stages are twice the size). sm90 bf16 / fp16 and the
interpreter have `runs` and `tma_store` on (R's GEMMs with w_right's rows run by run, no shuffle of the
intermediate's gradient, where the runs are whole tiles: monarch_kernel.runs_apply; tiles stored through
descriptors): on an H100 (session 38) the stores took ~2% off each GEMM and the runs 4% off nb 4's fwd+bwd
(WARPFORGE_MONARCH_RUNS / _TMA_STORE for A/B). Triton's automatic warp specialization (4 warps) was timed there too
and dropped: slower in every launch, as was running the shuffle passes on a side stream beside token chunks of the
GEMMs (session 39: the persistent GEMM leaves them nothing to overlap with).
"""
from typing import NamedTuple

from .._tiles import TileTable


class GemmCfg(NamedTuple):
    block_m: int  # tokens per tile
    block_n: int  # output columns of one block per tile
    block_k: int
    warps: int
    stages: int
    tma: bool = False          # A and W through tensor descriptors (where the block's K is whole tiles)
    programs_per_sm: int = 1   # the persistent grid: this many programs per SM, each walking tiles
    tma_store: bool = False    # tiles that are one box of the output leave through a tensor descriptor


class WgradCfg(NamedTuple):
    block_n: int  # rows of the weight-gradient tile (the output side of the factor)
    block_k: int  # its columns (the input side)
    block_t: int  # tokens per step of the walk over tokens
    warps: int
    stages: int
    splits: int = 0  # token ranges summed in fp32 afterwards; 0: enough to fill the SMs twice
    tma: bool = False  # G and A through tensor descriptors


class MonarchCfg(NamedTuple):
    gemm: GemmCfg
    wgrad: WgradCfg
    shuffle_elements: int = 4096  # elements per program of the backward's reordering of dy
    wgrad_blas: bool = False  # the weight gradients by the vendor's batched GEMM (torch.bmm on views, no copies)
    #                           instead of blockdiag_wgrad_kernel: on an H100 (session 39) cuBLAS's dL took 0.186 ms
    #                           against the kernel's 0.269 at nb 4 (0.112 / 0.139 at nb 16); the bias gradient is then
    #                           a sum of dy of its own
    runs: bool = False  # R's GEMMs take w_right's rows run by run (mode 3): no shuffle of the intermediate's gradient


C, G, W = MonarchCfg, GemmCfg, WgradCfg
_FP32 = C(G(64, 64, 32, 4, 3), W(64, 64, 32, 4, 3))
MONARCH = TileTable({
    "cpu": {"any": C(G(16, 16, 16, 1, 1, tma=True, tma_store=True), W(16, 16, 16, 1, 1, tma=True), 256, runs=True),
            "fp32": C(G(16, 16, 16, 1, 1), W(16, 16, 16, 1, 1), 256)},
    "default": {"any": C(G(64, 64, 32, 4, 3), W(64, 64, 32, 4, 3)), "fp32": _FP32},
    "sm90": {"any": C(G(128, 256, 64, 8, 3, tma=True, tma_store=True), W(128, 128, 64, 8, 3, tma=True), runs=True,
                      wgrad_blas=True),
             "fp32": _FP32},
})
