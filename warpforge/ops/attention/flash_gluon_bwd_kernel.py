"""The attention family's door to the Hopper Gluon backward (the kernel: ops/_gluon_flash_bwd.py, shared with sparse
attention): dense causal, windowed or unmasked attention over batched [b, s, h, d] inputs. The api gate (api.py)
dispatches here only on sm_90 with a Triton in GLUON_TRITON_VERSIONS."""
from .._gluon_flash_bwd import (BLOCK_N, GLUON_TRITON_VERSIONS, HEAD_DIMS, _buffers, available, compile_sm90, fits,
                                flash_bwd_gluon, group_split, head_group, key_rows_fits,
                                key_rows_knob, launch_args, smem_bytes)

__all__ = ["BLOCK_N", "GLUON_TRITON_VERSIONS", "HEAD_DIMS", "_buffers", "available", "compile_sm90", "fits",
           "flash_bwd_gluon", "group_split", "head_group", "key_rows_fits", "key_rows_knob",
           "launch_args", "smem_bytes"]
