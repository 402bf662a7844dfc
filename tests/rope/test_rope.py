"""apply_rope vs its reference: values and gradients, head dims whose half is not a power of two, bad input."""
import pytest
import torch

import warpforge as wf
from warpforge import WarpforgeInputError
from warpforge.testing import assert_grads_match, device_under_test, dtypes_under_test
from warpforge.ops.rope import rope_reference

DEV = device_under_test()
DTYPES = [torch.float32] + dtypes_under_test()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 7, 3, 32), (1, 5, 20, 64), (2, 3, 5, 40)])  # d 40: half not a power of 2
def test_rope(shape, dtype):
    b, s, h, d = shape
    x = torch.randn(shape, device=DEV, dtype=dtype, requires_grad=True)
    angles = torch.rand(s, d // 2, device=DEV) * 6
    cos, sin = angles.cos(), angles.sin()
    assert_grads_match(lambda a: wf.apply_rope(a, cos, sin, backend="triton"), lambda a: rope_reference(a, cos, sin),
                 [x], dtype)


def test_bad_input():
    with pytest.raises(WarpforgeInputError, match="^cos"):
        wf.apply_rope(torch.randn(1, 4, 2, 8, device=DEV), torch.ones(5, 4, device=DEV), torch.ones(4, 4, device=DEV),
                      backend="triton")
    with pytest.raises(WarpforgeInputError, match="^x: expected an even head dim"):
        wf.apply_rope(torch.randn(1, 4, 2, 7, device=DEV), torch.ones(4, 3, device=DEV), torch.ones(4, 3, device=DEV),
                      backend="triton")
