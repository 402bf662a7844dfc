"""SwiGLU: `swiglu` (SiLU(gate) · up from one gate_up tensor)."""
from .api import swiglu
from .reference import swiglu_reference

__all__ = ["swiglu", "swiglu_reference"]
