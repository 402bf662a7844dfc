"""Kernel families. Each folder: reference.py (what), *_kernel.py (how, fast), __init__.py (the door)."""
