"""Drop-in call shapes of other libraries over warpforge's ops: `compat.flash_mla` (FlashMLA's), `compat.flash_attn`
(flash-attn 2's) and `compat.vllm` (vLLM's fused_moe and its tuned-config files). Import the module you need: none is
imported here (compat.vllm installs its config lookup into ops.moe when imported)."""
