"""Block sizes per architecture for the attention kernels.

Keyed by arch (runtime.arch_key) and padded head dim. "cpu" is the Triton interpreter: small tiles so
that CI's small shapes still cross block boundaries. sm90 entries come from scripts/tune_attention.py on
an H200 (numbers in benchmarks/NOTES.md); an arch without a table falls back to "default", which is safe
rather than fast. sm90 enables TMA only at d 64 / 128, the dims tuned and verified on the H200 (d 32 / 96
with TMA are untested there: benchmarks/NOTES.md).
"""
from typing import NamedTuple


class KernelCfg(NamedTuple):
    block_m: int    # query rows per tile
    block_n: int    # key rows per tile
    warps: int
    stages: int
    tma: bool = False        # load the walked operand (K/V, or Q/dO in the dk/dv pass) through TMA descriptors
    atomic_dq: bool = False  # backward: dq by fp32 atomics inside the dk/dv pass (no second pass)


C = KernelCfg
_CPU = {d: C(16, 16, 1, 1) for d in (32, 64, 128, 256)}

FWD = {
    "cpu": _CPU,
    "default": {32: C(64, 64, 4, 2), 64: C(64, 64, 4, 2), 128: C(64, 64, 4, 2), 256: C(32, 32, 4, 1)},
    "sm90": {32: C(64, 64, 4, 3), 64: C(128, 64, 4, 3, tma=True), 128: C(128, 128, 8, 3, tma=True),
             256: C(64, 64, 4, 2)},
}

# dk/dv pass: a program owns block_n keys and walks block_m queries per step.
BWD_DKDV = {
    "cpu": _CPU,
    "default": {32: C(32, 64, 4, 2), 64: C(32, 64, 4, 2), 128: C(32, 64, 4, 2), 256: C(16, 32, 4, 1)},
    "sm90": {32: C(32, 64, 4, 2), 64: C(32, 64, 4, 3, tma=True), 128: C(64, 64, 4, 2, tma=True),
             256: C(32, 64, 4, 2)},
}

# dq pass: a program owns block_m queries and walks block_n keys per step.
BWD_DQ = {
    "cpu": _CPU,
    "default": {32: C(64, 32, 4, 2), 64: C(64, 32, 4, 2), 128: C(64, 32, 4, 2), 256: C(32, 16, 4, 1)},
    "sm90": {32: C(128, 64, 8, 3), 64: C(64, 64, 4, 3, tma=True), 128: C(128, 64, 8, 3, tma=True),
             256: C(64, 32, 4, 2)},
}


def pick(table, arch, head_dim_padded):
    return table.get(arch, table["default"])[head_dim_padded]
