"""linear_cross_entropy vs its reference: values and gradients over several chunks, ignored rows, bad input."""
import pytest
import torch

import warpforge as wf
from warpforge import WarpforgeInputError
from warpforge.testing import assert_grads_match, device_under_test, dtypes_under_test
from warpforge.ops.linear_ce import ce_chunk_rows, linear_cross_entropy_reference

DEV = device_under_test()
DTYPES = [torch.float32] + dtypes_under_test()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width,vocab", [(37, 64, 300), (5, 32, 5000)])
def test_linear_cross_entropy(rows, width, vocab, dtype, monkeypatch):
    from warpforge.ops.linear_ce import configs
    # several chunks even at these sizes
    monkeypatch.setattr(configs, "LINEAR_CE", configs.LINEAR_CE.map(lambda c: c._replace(chunk_elements=4 * vocab)))
    hidden = torch.randn(rows, width, device=DEV, dtype=dtype, requires_grad=True)
    weight = (0.2 * torch.randn(vocab, width, device=DEV, dtype=dtype)).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), device=DEV)
    targets[::4] = -100  # ignored rows
    assert_grads_match(lambda h, w: wf.linear_cross_entropy(h, w, targets, backend="triton"),
                 lambda h, w: linear_cross_entropy_reference(h, w, targets), [hidden, weight], dtype)


def test_ce_chunks_are_equal():
    assert ce_chunk_rows(16384, 50304, 1 << 28) == 4096  # 4 chunks of 4096, not 3 of 5336 and one of 376
    assert ce_chunk_rows(16384, 50304, 1 << 40) == 16384
    assert ce_chunk_rows(10, 1000, 1) == 1
    for rows, vocab, elements in [(37, 300, 1200), (16383, 50304, 1 << 26), (5, 5000, 20000)]:
        chunk = ce_chunk_rows(rows, vocab, elements)
        assert chunk * vocab <= max(elements, vocab) and -(-rows // chunk) * chunk - rows < chunk


def test_bad_input():
    x = torch.randn(2, 8, device=DEV)
    with pytest.raises(WarpforgeInputError, match="^targets"):
        wf.linear_cross_entropy(x, torch.randn(10, 8, device=DEV), torch.zeros(3, dtype=torch.long, device=DEV),
                                backend="triton")
