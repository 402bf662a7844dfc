"""Tiles for the MoE grouped GEMMs, per architecture, model shape and token count.

A model shape is (E, 2I, H) of w13; "any" serves shapes without their own entry. Within a shape the entry
with the largest token threshold <= T is used. "cpu" is the Triton interpreter (small tiles so that CI's
small shapes cross block boundaries). sm90 entries come from scripts/tune_moe.py on an H200 (numbers in
benchmarks/NOTES.md); an arch without a table falls back to "default", which is safe rather than fast.
"""
from typing import NamedTuple


class MoECfg(NamedTuple):
    block_m: int   # slots per row block (align's block_m): small for decode, where weights dominate
    up: tuple      # gate/up GEMM (and the per-slot backward GEMM, weight gradients): BLOCK_N, BLOCK_K, warps, stages
    down: tuple    # down GEMM with the scatter epilogue (and d_hidden): BLOCK_N, BLOCK_K, warps, stages
    split_k: int = 1  # down GEMM only: K cut into this many ranges, summed by the scatter's atomics
    wgrad: tuple | None = None  # weight-gradient kernel: BLOCK_N, BLOCK_K, warps, stages (None: `up`'s)


C = MoECfg
# the weight-gradient kernel at training sizes (scripts/tune_moe_wgrad.py, H200, T 8192): 128 x 256 tiles
# over 8 warps, 2 stages, beat the forward's 128 x 64 by 1.72x (Mixtral, 210 -> 361 TFLOP/s) and 1.87x (Qwen3)
WGRAD = (128, 256, 8, 2)
CONFIGS = {
    "cpu": {"any": {0: C(16, (32, 32, 1, 1), (32, 32, 1, 1))}},
    "default": {"any": {0: C(16, (64, 64, 4, 3), (64, 64, 4, 3)), 256: C(64, (64, 64, 4, 3), (64, 64, 4, 3))}},
    "sm90": {
        # untuned shapes (DeepSeek-V3's among them): the patterns the tuned shapes share
        "any": {0: C(16, (32, 256, 4, 4), (64, 128, 4, 3), 2), 16: C(16, (32, 128, 4, 4), (64, 128, 4, 3)),
                128: C(16, (128, 128, 4, 3), (64, 128, 4, 3)), 512: C(64, (128, 64, 8, 3), (128, 64, 8, 3)),
                2048: C(128, (128, 64, 8, 4), (256, 64, 8, 4), wgrad=WGRAD)},
        (8, 28672, 4096): {  # Mixtral-8x7B
            0: C(16, (32, 256, 4, 5), (128, 128, 4, 3), 4), 16: C(16, (32, 256, 4, 5), (64, 128, 4, 5), 4),
            64: C(32, (64, 128, 4, 3), (128, 128, 4, 3)), 128: C(64, (64, 128, 4, 4), (128, 128, 4, 4)),
            # T 512: a row block per expert (uniform routing), each weight tile read once: 1.31 -> 1.06 ms
            512: C(128, (128, 64, 8, 4), (128, 128, 8, 3)),
            2048: C(128, (128, 64, 8, 4), (256, 64, 8, 4), wgrad=WGRAD)},
        (128, 1536, 2048): {  # Qwen3-30B-A3B
            0: C(16, (32, 256, 4, 3), (128, 64, 4, 3), 2), 16: C(16, (32, 128, 4, 4), (64, 128, 4, 3)),
            128: C(16, (128, 128, 4, 3), (64, 128, 4, 3)), 2048: C(128, (128, 64, 8, 4), (256, 64, 8, 4), wgrad=WGRAD)},
    },
}


# Archs where inference routing (route_kernel.py) and `align` (align_kernel.py, decode sizes) run as one Triton
# launch each instead of ~25 small torch kernels. On by arch once their GPU tests have passed there: "cpu" is
# the interpreter (CI), sm90 the H200.
ONE_LAUNCH_ROUTING = {"cpu", "sm90"}


def pick(arch: str, shape: tuple, tokens: int) -> MoECfg:
    table = CONFIGS.get(arch, CONFIGS["default"])
    by_tokens = table.get(tuple(shape), table["any"])
    return by_tokens[max(k for k in by_tokens if k <= tokens)]
