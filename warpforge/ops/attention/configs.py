"""Tiles for the attention kernels: arch -> padded head dim -> KernelCfg (see ops/_tiles.py).

"cpu" is the Triton interpreter: small tiles so that CI's small shapes still cross block boundaries. sm90
entries come from scripts/tune_attention.py on an H200 (benchmarks/NOTES.md); "default" serves any other
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


C = KernelCfg
_CPU = {"any": C(16, 16, 1, 1)}
# fp32 inputs (matmuls in full fp32 precision): tiles sized for 4-byte elements, correct rather than fast
_FP32_FWD = {("fp32", 32): C(64, 32, 4, 2), ("fp32", 64): C(64, 32, 4, 2), ("fp32", 128): C(32, 32, 4, 2),
             ("fp32", 256): C(32, 16, 4, 1)}
_FP32_BWD = {("fp32", 32): C(32, 32, 4, 1), ("fp32", 64): C(32, 32, 4, 1), ("fp32", 128): C(32, 32, 4, 1),
             ("fp32", 256): C(16, 16, 4, 1)}

FWD = TileTable({
    "cpu": _CPU,
    "default": {32: C(64, 64, 4, 2), 64: C(64, 64, 4, 2), 128: C(64, 64, 4, 2), 256: C(32, 32, 4, 1), **_FP32_FWD},
    "sm90": {32: C(64, 64, 4, 3), 64: C(128, 64, 4, 3, tma=True), 128: C(128, 128, 8, 3, tma=True),
             256: C(64, 64, 4, 2), **_FP32_FWD},
})

# dk/dv pass: a program owns block_n keys and walks block_m queries per step.
BWD_DKDV = TileTable({
    "cpu": _CPU,
    "default": {32: C(32, 64, 4, 2), 64: C(32, 64, 4, 2), 128: C(32, 64, 4, 2), 256: C(16, 32, 4, 1), **_FP32_BWD},
    "sm90": {32: C(32, 64, 4, 2), 64: C(32, 64, 4, 3, tma=True), 128: C(64, 64, 4, 2, tma=True),
             256: C(32, 64, 4, 2), **_FP32_BWD},
})

# dq pass: a program owns block_m queries and walks block_n keys per step.
BWD_DQ = TileTable({
    "cpu": _CPU,
    "default": {32: C(64, 32, 4, 2), 64: C(64, 32, 4, 2), 128: C(64, 32, 4, 2), 256: C(32, 16, 4, 1), **_FP32_BWD},
    "sm90": {32: C(128, 64, 8, 3), 64: C(64, 64, 4, 3, tma=True), 128: C(128, 64, 8, 3, tma=True),
             256: C(64, 32, 4, 2), **_FP32_BWD},
})
