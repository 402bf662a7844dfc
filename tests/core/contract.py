"""What the contract tests share: the device under test, both backends, and the check that a call is refused by
name (a WarpforgeInputError whose message starts with the argument)."""
import pytest
import torch

from warpforge import WarpforgeInputError
from warpforge.testing import device_under_test

DEV = device_under_test()
BACKENDS = ["triton", "reference"]
ON_CPU = DEV.type == "cpu"


def raises(name, fn):
    with pytest.raises(WarpforgeInputError, match=rf"^{name}"):
        fn()


def rn(*shape, dtype=torch.float32):
    """Fresh random data on the device under test."""
    return torch.randn(*shape, device=DEV, dtype=dtype)
