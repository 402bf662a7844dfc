"""`MonarchLinear`: a drop-in for nn.Linear whose weight is a Monarch matrix (two block-diagonal factors and the
perfect shuffle between them, warpforge.ops.monarch), with `from_dense` to project a trained nn.Linear onto it."""
from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import check_bool, fail
from ..ops.monarch import monarch_dense_reference, monarch_project
from . import functional as F


class MonarchLinear(nn.Module):
    """x [..., d_in] -> [..., d_out] through d_mid = min(d_in, d_out) (fly's MonarchLinear): parameters
    w_right [nblocks, d_mid / nblocks, d_in / nblocks], w_left [nblocks, d_out / nblocks, d_mid / nblocks] and
    bias [d_out]. d_in and d_out must be divisible by nblocks. backend: None (Triton kernels on CUDA, the
    reference on CPU), "triton", "reference", "torch" (two bmms and the shuffles as copies), or a dict keyed by
    "monarch" (warpforge.nn.functional)."""

    def __init__(self, d_in: int, d_out: int, nblocks: int, bias: bool = True, backend: F.Backend = None, *,
                 device=None, dtype=None):
        super().__init__()
        F.check_size("d_in", d_in)
        F.check_size("d_out", d_out)
        F.check_size("nblocks", nblocks)
        check_bool("bias", bias)
        backend = F.check_backend(backend)
        if dtype is not None and dtype not in F.FLOATS:  # what monarch_linear runs on
            fail("dtype", "None or one of (float16, bfloat16, float32)", repr(dtype))
        if dtype is None and torch.get_default_dtype() not in F.FLOATS:
            fail("dtype", "None with a default dtype of float16, bfloat16 or float32 (or one of those)",
                 f"None with the default {torch.get_default_dtype()}")
        try:
            device = None if device is None else torch.device(device)
        except (RuntimeError, TypeError):
            fail("device", "None, a torch.device or a device string", repr(device))
        for name, d in (("d_in", d_in), ("d_out", d_out)):
            if d % nblocks:
                fail(name, f"a multiple of nblocks ({nblocks})", d)
        self.d_in, self.d_out, self.nblocks, self.backend = d_in, d_out, nblocks, backend
        d_mid = min(d_in, d_out)
        kw = dict(device=device, dtype=dtype)
        self.w_right = nn.Parameter(torch.empty(nblocks, d_mid // nblocks, d_in // nblocks, **kw))
        self.w_left = nn.Parameter(torch.empty(nblocks, d_out // nblocks, d_mid // nblocks, **kw))
        self.bias = nn.Parameter(torch.empty(d_out, **kw)) if bias else None
        self.reset_parameters()

    @property
    def d_mid(self) -> int:
        return self.w_right.shape[0] * self.w_right.shape[1]

    def reset_parameters(self) -> None:
        """Each block as nn.Linear initialises a weight of its fan-in; the bias by the layer's d_in."""
        for w in (self.w_right, self.w_left):
            bound = 1.0 / math.sqrt(w.shape[2])
            nn.init.uniform_(w, -bound, bound)
        if self.bias is not None:
            bound = 1.0 / math.sqrt(self.d_in)
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Under autocast, as nn.Linear: x and the parameters in autocast's dtype (monarch_linear, a custom op, is
        not cast by autocast itself)."""
        F.check_input(x, self.d_in, self.w_right)  # the op would name its weights; x is what does not fit
        w_left, w_right, bias = self.w_left, self.w_right, self.bias
        dtype = F.compute_dtype(x.device, w_right.dtype)
        if dtype != w_right.dtype or x.dtype != dtype:
            x, w_left, w_right = x.to(dtype), w_left.to(dtype), w_right.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        return F.monarch_linear(x, w_left, w_right, bias, backend=self.backend)

    def dense_weight(self) -> torch.Tensor:
        """The dense weight [d_out, d_in] (fp32) this layer applies, as nn.Linear's."""
        return monarch_dense_reference(self.w_left.detach(), self.w_right.detach())

    @classmethod
    def from_dense(cls, linear: nn.Linear, nblocks: int, backend: F.Backend = None) -> "MonarchLinear":
        """The MonarchLinear nearest to `linear` (the Frobenius-nearest Monarch weight, by a truncated SVD per pair
        of blocks: monarch_project), with its bias copied; on linear's device and dtype."""
        if not isinstance(linear, nn.Linear):
            fail("linear", "a torch.nn.Linear", type(linear).__name__)
        w = linear.weight
        if isinstance(w, nn.parameter.UninitializedParameter):
            fail("linear", "an initialised nn.Linear", "a lazy module not yet run")
        if w.dtype not in F.FLOATS:
            fail("linear", "weights in float16, bfloat16 or float32 (what monarch_linear runs on)", str(w.dtype))
        F.check_size("nblocks", nblocks)
        for name, width in (("in_features", linear.in_features), ("out_features", linear.out_features)):
            if width % nblocks:  # named here: the constructor's d_in / d_out are not from_dense's arguments
                fail("linear", f"{name} a multiple of nblocks ({nblocks})", f"{name} {width}")
        out = cls(linear.in_features, linear.out_features, nblocks, bias=linear.bias is not None, backend=backend,
                  device=w.device, dtype=w.dtype)
        w_left, w_right = monarch_project(w.detach(), nblocks, out.d_mid)
        with torch.no_grad():
            out.w_left.copy_(w_left)
            out.w_right.copy_(w_right)
            if linear.bias is not None:
                out.bias.copy_(linear.bias)
        return out

    def extra_repr(self) -> str:
        return f"d_in={self.d_in}, d_out={self.d_out}, nblocks={self.nblocks}, bias={self.bias is not None}"
