"""swiglu vs its reference: values and gradients, bad input."""
import pytest
import torch

import warpforge as wf
from warpforge import WarpforgeInputError
from warpforge.testing import assert_grads_match, device_under_test, dtypes_under_test
from warpforge.ops.swiglu import swiglu_reference

DEV = device_under_test()
DTYPES = [torch.float32] + dtypes_under_test()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 6, 2 * 40), (3, 2 * 1500)])
def test_swiglu(shape, dtype):
    gu = torch.randn(shape, device=DEV, dtype=dtype, requires_grad=True)
    assert_grads_match(lambda a: wf.swiglu(a, backend="triton"), swiglu_reference, [gu], dtype)


def test_bad_input():
    with pytest.raises(WarpforgeInputError, match="^gate_up"):
        wf.swiglu(torch.randn(2, 7, device=DEV), backend="triton")
