"""Kernel families, one folder each: reference.py (what it computes), <name>_kernel.py (kernels and their launch),
configs.py (tile tables), api.py (validate -> plan -> dispatch), __init__.py (re-exports). _op.py defines ops,
_tiles.py the tile table, shared_kernels.py the Triton helpers several families use. CONTRIBUTING.md says how to
add a family."""
