"""Hugging Face transformers on warpforge's kernels: patching (Liger-Kernel's manner) and
`attn_implementation="warpforge"`. Needs transformers (`pip install "warpforge[hf]"`); importing this package
registers the attention implementation (attention.py does, on import)."""
from .attention import NAME, register, warpforge_attention_forward, warpforge_mask
from .patch import (apply_warpforge, apply_warpforge_kernel_to_llama, apply_warpforge_kernel_to_mixtral,
                    apply_warpforge_kernel_to_qwen3, revert_warpforge_kernels)

__all__ = ["NAME", "register", "warpforge_attention_forward", "warpforge_mask", "apply_warpforge",
           "apply_warpforge_kernel_to_llama", "apply_warpforge_kernel_to_qwen3", "apply_warpforge_kernel_to_mixtral",
           "revert_warpforge_kernels"]
