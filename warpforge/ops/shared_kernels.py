"""Triton helpers that more than one family's kernels use (kernel files import them from here, never from another
family)."""
import triton
import triton.language as tl


@triton.jit
def swiglu_grads(d_out, gate, up):
    """(d gate, d up) of out = SiLU(gate) · up, all fp32: the SwiGLU backward and the MoE backward's GEMM
    epilogue."""
    sig = tl.sigmoid(gate)
    return d_out * up * sig * (1.0 + gate * (1.0 - sig)), d_out * gate * sig
