"""The attention family's door to the Hopper Gluon forward (the kernel: ops/_gluon_flash_fwd.py, shared with sparse
attention): dense causal, windowed or unmasked attention over batched [b, s, h, d] inputs. The api gate (api.py)
dispatches here only on sm_90 with a Triton in GLUON_TRITON_VERSIONS."""
from .._gluon_flash_fwd import (BLOCK_M, CONSUMER_REGS, GLUON_TRITON_VERSIONS, HEAD_DIMS, LOG2E,
                                MAXNREG, PRODUCER_REGS, SMEM_MAX, WG_ROWS, available, compile_sm90, fits,
                                flash_fwd_gluon, launch_args, smem_bytes)

__all__ = ["BLOCK_M", "CONSUMER_REGS", "GLUON_TRITON_VERSIONS", "HEAD_DIMS", "LOG2E", "MAXNREG", "PRODUCER_REGS",
           "SMEM_MAX", "WG_ROWS", "available", "compile_sm90", "fits", "flash_fwd_gluon", "launch_args", "smem_bytes"]
