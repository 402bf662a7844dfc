"""The distributed ops on 2+ GPUs over NCCL, in bf16 through the GPU kernels (the gloo tests check the logic on CPU
in fp32): ring attention and expert-parallel MoE against one GPU on the whole input, ZeRO-2 against DDP."""
import pytest
import torch

from .harness import run_ranks

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (a multi-GPU device kind)")]


def _rel(a, b):
    a, b = a.float().cpu(), b.float().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def _qkv(s, h_q, h_kv, d):
    g = torch.Generator(device="cuda").manual_seed(0)
    return [torch.randn(1, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for h in (h_q, h_kv, h_kv, h_q)]


def _ring(rank, world, s, h_q, h_kv, d, layout):
    from warpforge.distributed import ring_attention, shard_sequence
    q, k, v, do = (shard_sequence(t, rank, world, layout).contiguous() for t in _qkv(s, h_q, h_kv, d))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = ring_attention(q, k, v, causal=True, layout=layout)
    out.backward(do)
    return dict(out=out, dq=q.grad, dk=k.grad, dv=v.grad)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("d", [64, 128])
def test_ring_attention_bf16_matches_one_gpu(layout, d):
    import warpforge as wf
    from warpforge.distributed import unshard_sequence
    s, h_q, h_kv = 4096, 8, 2
    got = run_ranks(_ring, 2, s, h_q, h_kv, d, layout, backend="nccl")
    q, k, v, do = _qkv(s, h_q, h_kv, d)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = wf.flash_attention(q, k, v, causal=True)
    out.backward(do)
    for name, want in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        full = unshard_sequence([g[name] for g in got], layout)
        assert _rel(full, want) < 2e-2, name


def _ep(rank, world, t, h, i, e, k):
    from warpforge.distributed import expert_parallel_experts, local_expert_range
    from warpforge.ops.moe import route
    g = torch.Generator(device="cuda").manual_seed(1)
    w13 = (torch.randn(e, 2 * i, h, device="cuda", generator=g) * h ** -0.5).bfloat16()
    w2 = (torch.randn(e, h, i, device="cuda", generator=g) * i ** -0.5).bfloat16()
    g.manual_seed(2 + rank)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    logits = torch.randn(t, e, device="cuda", generator=g)
    dy = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=g)
    weights, ids = route(logits, k)
    own = local_expert_range(e)
    w13l, w2l = (w[own.start:own.stop].clone().requires_grad_() for w in (w13, w2))
    out = expert_parallel_experts(x, w13l, w2l, weights, ids, num_experts=e)
    out.backward(dy)
    return dict(out=out, dx=x.grad, dw13=w13l.grad, dw2=w2l.grad, x=x.detach(), weights=weights, ids=ids, dy=dy)


def test_expert_parallel_bf16_matches_one_gpu():
    from warpforge.ops.moe import experts
    t, h, i, e, k = 512, 256, 512, 8, 2
    got = run_ranks(_ep, 2, t, h, i, e, k, backend="nccl")
    g = torch.Generator(device="cuda").manual_seed(1)
    w13 = (torch.randn(e, 2 * i, h, device="cuda", generator=g) * h ** -0.5).bfloat16().requires_grad_()
    w2 = (torch.randn(e, h, i, device="cuda", generator=g) * i ** -0.5).bfloat16().requires_grad_()
    x = torch.cat([r["x"] for r in got]).cuda().requires_grad_()
    out = experts(x, w13, w2, torch.cat([r["weights"] for r in got]).cuda(), torch.cat([r["ids"] for r in got]).cuda())
    out.backward(torch.cat([r["dy"] for r in got]).cuda())
    assert _rel(torch.cat([r["out"] for r in got]), out) < 1e-2
    assert _rel(torch.cat([r["dx"] for r in got]), x.grad) < 1e-2
    assert _rel(torch.cat([r["dw13"] for r in got]), w13.grad) < 1e-2
    assert _rel(torch.cat([r["dw2"] for r in got]), w2.grad) < 1e-2


def _zero_vs_ddp(rank, world):
    from .test_zero import _ranks
    return {how: _ranks(rank, world, how, 0.004, "cuda")["losses"] for how in ("ddp", "zero2")}


def test_zero2_matches_ddp_over_nccl():
    got = run_ranks(_zero_vs_ddp, 2, backend="nccl")
    for r in got:
        assert r["zero2"] == pytest.approx(r["ddp"], rel=1e-4)


def _sparse_inputs(s):
    g = torch.Generator(device="cuda").manual_seed(4)
    shapes = ((8, 128), (2, 128), (2, 128), (8, 128), (2, 32), (1, 32))  # q, k, v, d_out, index_q, index_k
    return [torch.randn(1, s, h, d, device="cuda", generator=g).bfloat16() for h, d in shapes]


def _sparse_cp(rank, world, s):
    from warpforge.distributed import sparse_attention_cp
    n = s // world
    q, k, v, do, iq, ik = (t[:, rank * n:(rank + 1) * n].contiguous() for t in _sparse_inputs(s))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = sparse_attention_cp(q, k, v, index_q=iq, index_k=ik, block_size=128, topk=4)
    out.backward(do)
    return dict(out=out, dq=q.grad, dk=k.grad, dv=v.grad)


def test_sparse_attention_cp_bf16_matches_one_gpu():
    import warpforge as wf
    s = 4096
    got = run_ranks(_sparse_cp, 2, s, backend="nccl")
    q, k, v, do, iq, ik = _sparse_inputs(s)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = wf.sparse_attention(q, k, v, index_q=iq, index_k=ik, block_size=128, topk=4)
    out.backward(do)
    for name, want in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        assert _rel(torch.cat([g[name] for g in got], 1), want) < 2e-2, name
