"""SwiGLU in plain PyTorch: what the SwiGLU kernels compute."""
from __future__ import annotations

import torch.nn.functional as F


def swiglu_reference(gate_up):
    """gate_up [..., 2I] (gate first, then up) -> silu(gate) * up [..., I]."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)
