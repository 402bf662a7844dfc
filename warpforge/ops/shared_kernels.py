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


@triton.jit
def dot(a, b, acc=None):
    """tl.dot, in full fp32 precision when the operands are fp32 (tl.dot's default for them is TF32, ~1e-3 off)."""
    if a.dtype == tl.float32:
        out = tl.dot(a, b, acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out
