"""Block sizes per architecture for the attention kernels: (BLOCK_M, BLOCK_N, num_warps, num_stages).

Keyed by arch (runtime.arch_key) and padded head dim. "cpu" is the Triton interpreter: small tiles so
that CI's small shapes still cross block boundaries. Entries for sm90 come from
scripts/tune_attention.py on an H200 (see benchmarks/NOTES.md); an arch without a table falls back to
"default", which is safe rather than fast.
"""

FWD = {
    "cpu": {32: (16, 16, 1, 1), 64: (16, 16, 1, 1), 128: (16, 16, 1, 1), 256: (16, 16, 1, 1)},
    "default": {32: (64, 64, 4, 2), 64: (64, 64, 4, 2), 128: (64, 64, 4, 2), 256: (32, 32, 4, 1)},
    "sm90": {32: (128, 64, 4, 3), 64: (128, 64, 4, 3), 128: (128, 64, 8, 3), 256: (64, 64, 4, 2)},
}

# dk/dv pass: BLOCK_N keys owned by a program, BLOCK_M queries per step.
BWD_DKDV = {
    "cpu": {32: (16, 16, 1, 1), 64: (16, 16, 1, 1), 128: (16, 16, 1, 1), 256: (16, 16, 1, 1)},
    "default": {32: (32, 64, 4, 2), 64: (32, 64, 4, 2), 128: (32, 64, 4, 2), 256: (16, 32, 4, 1)},
    "sm90": {32: (64, 128, 8, 2), 64: (64, 128, 8, 2), 128: (64, 128, 8, 2), 256: (32, 64, 4, 2)},
}

# dq pass: BLOCK_M queries owned by a program, BLOCK_N keys per step.
BWD_DQ = {
    "cpu": {32: (16, 16, 1, 1), 64: (16, 16, 1, 1), 128: (16, 16, 1, 1), 256: (16, 16, 1, 1)},
    "default": {32: (64, 32, 4, 2), 64: (64, 32, 4, 2), 128: (64, 32, 4, 2), 256: (32, 16, 4, 1)},
    "sm90": {32: (128, 64, 8, 2), 64: (128, 64, 8, 2), 128: (128, 64, 8, 2), 256: (64, 32, 4, 2)},
}


def pick(table, arch, head_dim_padded):
    return table.get(arch, table["default"])[head_dim_padded]
