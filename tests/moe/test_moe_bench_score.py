"""The MoE training bench scores gradients against an fp32 reference computed one expert at a time (DeepSeek-V3's
whole-layer fp32 reference does not fit on the GPU beside the run): it must give rel_l2 over the whole tensors."""
import pytest
import torch

from warpforge.bench.moe_cases import streamed_grads_error
from warpforge.ops.moe import experts_reference, route_reference
from warpforge.testing import rel_l2


@pytest.mark.parametrize("route_kw,e,k", [({}, 6, 2),
                                          (dict(scoring="sigmoid", num_expert_group=4, topk_group=2,
                                                routed_scaling_factor=2.5), 8, 3)])
def test_streamed_error_is_the_whole_tensor_rel_l2(route_kw, e, k):
    torch.manual_seed(0)
    t, h, i = 11, 16, 24
    x = torch.randn(t, h)
    w13, w2 = torch.randn(e, 2 * i, h) / h ** 0.5, torch.randn(e, h, i) / i ** 0.5
    w13[e - 1] = 0  # an expert nobody may pick stays in the sums
    logits, grad = torch.randn(t, e), torch.randn(t, h)
    ins = [x.clone().requires_grad_(), w13.clone().requires_grad_(), w2.clone().requires_grad_(),
           logits.clone().requires_grad_()]
    weights, ids = route_reference(ins[3], k, **route_kw)
    ref = torch.autograd.grad(experts_reference(ins[0], ins[1], ins[2], weights, ids), ins, grad)
    noisy = [r + 1e-3 * torch.randn_like(r) * r.abs().max() for r in ref]
    want = max(rel_l2(a, b) for a, b in zip(noisy, ref))
    got = streamed_grads_error(noisy, x, w13, w2, logits, k, route_kw, grad)
    assert got == pytest.approx(want, rel=1e-6)
    assert streamed_grads_error(ref, x, w13, w2, logits, k, route_kw, grad) < 1e-6
    noisy[2][0, 0, 0] = float("nan")
    assert streamed_grads_error(noisy, x, w13, w2, logits, k, route_kw, grad) == float("inf")
