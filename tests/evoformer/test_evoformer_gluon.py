"""The Hopper pass that computes the Evoformer backward's dq and pair-bias gradient in one walk
(ops/evoformer/dq_dbias_gluon_kernel.py): which biases and shapes it takes, its MSA-row groups, its sm_90 compile
(Gluon has no interpreter: compiled here without a GPU), and on an H100 / H200 its gradients against the portable
passes and the float64 reference, bitwise reproducible."""
import os

import pytest
import torch

import warpforge as wf
from warpforge.ops.evoformer import configs
from warpforge.ops.evoformer import dq_dbias_gluon_kernel as gk, gluon_shared_kernel as plan
from warpforge.ops.shared_kernels import triton_launch
from warpforge.testing import cosine, rel_l2

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _views(B, S, R, H, shapes):
    """Expanded [B, S, H, R, R] views of biases of the given shapes, as the backward gets them."""
    full = (B, S, H, R, R)
    return [torch.empty(s).reshape((1,) * (5 - len(s)) + tuple(s)).expand(full) for s in shapes]


@pytest.mark.parametrize("shapes,takes", [
    ([(1, 4, 1, 1, 40), (1, 1, 2, 40, 40)], "pair+mask"),   # mask, pair
    ([(1, 1, 2, 40, 40)], "pair"),                           # pair alone
    ([(2, 40, 40), (1, 4, 2, 1, 40)], "pair+mask"),          # [H, R, R] pair, a per-head mask
    ([(1, 4, 1, 1, 40)], None),                              # no pair: nothing to sum
    ([(1, 1, 1, 40, 40), (1, 1, 2, 40, 40)], None),          # two shared tiles
    ([(1, 4, 2, 40, 40)], None),                             # a per-row tile
])
def test_split_biases(shapes, takes):
    got = plan.split_biases(_views(1, 4, 40, 2, shapes), 4)
    if takes is None:
        assert got is None
    else:
        pair, mask = got
        assert pair.stride(3) != 0 and (mask is not None) == ("mask" in takes)


def test_fits_only_what_it_takes():
    biases = _views(1, 4, 40, 2, [(1, 1, 2, 40, 40)])
    assert plan.fits(torch.empty(1, 4, 40, 2, 32, dtype=torch.bfloat16), biases)
    assert plan.fits(torch.empty(1, 4, 40, 2, 16, dtype=torch.float16), biases)
    assert not plan.fits(torch.empty(1, 4, 40, 2, 32), biases)                       # fp32
    assert not plan.fits(torch.empty(1, 4, 40, 2, 64, dtype=torch.bfloat16), biases)  # d 64: no room for two rows
    wide = _views(1, 4, 400, 2, [(1, 1, 2, 400, 400)])
    assert not plan.fits(torch.empty(1, 4, 400, 2, 32, dtype=torch.bfloat16), wide)  # past six key blocks


@pytest.mark.parametrize("BH,S", [(8, 512), (4, 384), (8, 5120), (2, 64)])
def test_groups_fill_the_waves(BH, S):
    """Row (B · H 8), triangle (4) and extra-MSA shapes: whole waves at least 90% full, the fewest groups that do."""
    G = plan.groups(BH, 6, S, 132)
    waves = BH * 6 * G / 132
    assert waves >= 1 and waves / -(-waves // 1) >= 0.9
    assert all(waves_g / -(-waves_g // 1) < 0.9 or waves_g < 1 for waves_g in (BH * 6 * g / 132 for g in range(1, G)))


def test_groups_bounded_by_the_rows():
    assert plan.groups(8, 6, 3, 132) <= 3
    assert plan.groups(1000, 6, 512, 132) == 1


@pytest.mark.parametrize("R", [40, 37])  # 37: rows padded to 16 bytes for TMA
@pytest.mark.parametrize("mask_heads", [1, 2])
def test_log2_biases(R, mask_heads):
    """The biases as the kernels read them (evo_log2_biases_kernel, one launch): fp32 · log2 e, the pair [B · H, R, R]
    (the dk/dv kernel's transposed through a transposed view), the mask [B · S · Hm, R]; 16-byte rows; -inf stays
    -inf."""
    B, S, H = 2, 3, 2
    full = (B, S, H, R, R)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    pair = torch.randn(B, 1, H, R, R, dtype=torch.bfloat16, device=dev)
    mask = torch.zeros(B, S, mask_heads, 1, R, device=dev)
    mask[..., ::3] = float("-inf")
    pair2, mask2, heads = plan.log2_biases(pair.expand(full), mask.expand(full), B, S, H, R, triton_launch)
    assert heads == mask_heads and pair2.shape == (B * H, R, R) and mask2.shape == (B * S * mask_heads, R)
    assert pair2.stride(1) % 4 == 0 and mask2.stride(0) % 4 == 0 and pair2.dtype == mask2.dtype == torch.float32
    assert torch.equal(pair2, (pair[:, 0].float() * plan.LOG2E).reshape(B * H, R, R))
    assert torch.equal(mask2, (mask[:, :, :, 0] * plan.LOG2E).reshape(-1, R))
    pair2t, _, _ = plan.log2_biases(pair.expand(full).transpose(3, 4), None, B, S, H, R, triton_launch)
    assert torch.equal(pair2t, pair2.transpose(1, 2))


@pytest.mark.parametrize("G", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sum_partials(G, dtype):
    """The merged pass's G fp32 partials summed in group order and cast once, into the bias's dtype."""
    n = 3000  # crosses the 1024-element blocks
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    part = torch.randn(G, n, device=dev)
    out = torch.empty(n, dtype=dtype, device=dev)
    triton_launch(gk.evo_sum_partials_kernel, (-(-n // gk.SUM_BLOCK),), part, out, n, G, BLOCK=gk.SUM_BLOCK)
    want = part[0].clone()
    for g in range(1, G):
        want += part[g]
    if dtype == torch.float32 or dev == "cuda":
        assert torch.equal(out, want.to(dtype))
    else:  # the interpreter's fp32 -> bf16 cast truncates (a GPU's rounds to nearest even): within one bf16 step
        torch.testing.assert_close(out.float(), want, rtol=2 ** -7, atol=0)


def test_dbias_dtype_is_the_bias_dtype_only_where_nothing_is_summed():
    """The backward writes the pair bias's gradient in its dtype when it has the score gradient's shape (one cast in
    the kernel), in fp32 where the result is summed further (a bias broadcast over B or H) or two biases want it."""
    from warpforge.ops.evoformer import api
    q = torch.empty(2, 3, 8, 4, 16, dtype=torch.float16)
    pair = torch.empty(2, 1, 4, 8, 8, dtype=torch.bfloat16)
    assert api._dbias_dtype(q, [pair]) == torch.bfloat16
    assert api._dbias_dtype(q, [torch.empty(4, 8, 8, dtype=torch.bfloat16)]) == torch.float32  # summed over B
    assert api._dbias_dtype(q, [torch.empty(2, 1, 1, 8, 8, dtype=torch.bfloat16)]) == torch.float32  # over H
    assert api._dbias_dtype(q, [pair, pair]) == torch.float32


def _gluon_triton():
    import triton
    return triton.__version__.startswith(gk.GLUON_TRITON_VERSIONS)


COMPILE_CASES = [dict(R=384, D=32, mask=True), dict(R=300, D=16, mask=False, dtype="float16"),
                 dict(R=100, D=32, mask=True, H=3)]
KERNELS = ["dq_dbias_gluon_kernel", "fwd_gluon_kernel", "dkdv_gluon_kernel"]


@pytest.mark.skipif(not _gluon_triton(), reason=f"the Gluon kernel is written for Triton {gk.GLUON_TRITON_VERSIONS}")
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("case", COMPILE_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_compiles_for_sm90(case, kernel):
    from warpforge.ops._gluon import SMEM_MAX, compile_in_subprocess
    r = compile_in_subprocess(f"warpforge.ops.evoformer.{kernel}", case, ROOT)
    print(f"\n{case}: {r['registers']} registers (setmaxnreg {r['setmaxnreg_values']}), spills {r['spill_stores']}/"
          f"{r['spill_loads']} B, shared {r['shared_bytes']} B, {r['wgmma_count']} wgmma")
    assert r["wgmma"] and r["tma"] and r["mbarrier"] and r["warp_specialize"] and r["num_warps"] == 12
    assert r["ptxas_rc"] == 0 and not r["wgmma_serialized"], r["ptxas_log"]
    assert r["shared_bytes"] <= SMEM_MAX
    assert r["spill_stores"] <= 256, r["ptxas_log"]  # a few registers around a row's first step (ptxas)


@pytest.mark.skipif(not _gluon_triton(), reason=f"the Gluon kernel is written for Triton {gk.GLUON_TRITON_VERSIONS}")
def test_forward_with_three_consumers_compiles_for_sm90():
    """The forward's knob WARPFORGE_EVO_GLUON_FWD_CONSUMERS=3: 16 warps, within sm_90's shared memory at N_res 384."""
    from warpforge.ops._gluon import SMEM_MAX, compile_in_subprocess
    r = compile_in_subprocess("warpforge.ops.evoformer.fwd_gluon_kernel", dict(R=384, D=32, nc=3), ROOT)
    assert r["warp_specialize"] and r["num_warps"] == 16 and r["ptxas_rc"] == 0 and not r["wgmma_serialized"]
    assert r["shared_bytes"] <= SMEM_MAX and r["spill_stores"] <= 64, r["ptxas_log"]


@pytest.mark.skipif(not _gluon_triton(), reason=f"the Gluon kernel is written for Triton {gk.GLUON_TRITON_VERSIONS}")
def test_forward_at_one_batch_head_and_d16_compiles_for_sm90():
    """d 16 with a ragged last block, and B · H = 1 (an int argument of 1 is a constant to Triton: the row-scale
    plane once took its offset from one and failed to compile)."""
    from warpforge.ops._gluon import SMEM_MAX, compile_in_subprocess
    small = compile_in_subprocess("warpforge.ops.evoformer.fwd_gluon_kernel", dict(R=200, D=16, H=1, B=1), ROOT)
    assert small["ptxas_rc"] == 0 and small["shared_bytes"] <= SMEM_MAX, small["ptxas_log"]


def _on_sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and _gluon_triton()


GPU_CASES = [  # B, S, R, H, D, mask ("row": [B, S, 1, 1, R], "head": [B, S, H, 1, R], None), dtype
    (1, 40, 384, 4, 32, "row", torch.bfloat16),     # whole blocks, several MSA-row groups
    (2, 7, 300, 2, 16, "head", torch.float16),      # a ragged last block, a per-head mask
    (1, 3, 100, 3, 32, None, torch.bfloat16),       # one group (written straight), no mask
    (1, 64, 65, 2, 32, "row", torch.bfloat16),      # one key past a block
    (1, 5, 256, 1, 16, "row", torch.float16),       # four whole blocks at d 16, B · H = 1
]


@pytest.mark.gpu
@pytest.mark.skipif(not _on_sm90(), reason="the Gluon pass runs on sm_90 with its Triton")
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "b{}_s{}_r{}_h{}_d{}_{}".format(*c[:6]))
def test_gpu_matches_the_portable_passes_and_the_reference(case, monkeypatch):
    B, S, R, H, D, mask_kind, dtype = case
    dev = "cuda"
    q, k, v, g = (torch.randn(B, S, R, H, D, device=dev, dtype=dtype).requires_grad_() for _ in range(4))
    pair = torch.randn(B, 1, H, R, R, device=dev, dtype=dtype).requires_grad_()
    biases = [pair]
    if mask_kind:
        keep = torch.rand(B, S, H if mask_kind == "head" else 1, 1, R, device=dev) > 0.2
        keep[..., 0] = True
        biases.insert(0, torch.zeros(keep.shape, device=dev).masked_fill(~keep, float("-inf")))
    biases_grad = [b for b in biases if b.requires_grad]
    d_out = torch.randn_like(q)

    def grads(on):
        monkeypatch.setenv(configs.GLUON_ENV, "1" if on else "0")
        monkeypatch.setenv(configs.GLUON_FWD_ENV, "1" if on else "0")
        monkeypatch.setenv(configs.GLUON_DKDV_ENV, "1" if on else "0")
        out = wf.evoformer_attention(q, k, v, biases, gate=g, backend="triton")
        return (out, *torch.autograd.grad(out, [q, k, v, g, *biases_grad], d_out))
    portable, got, again = grads(False), grads(True), grads(True)
    from warpforge.ops.evoformer import evoformer_attention_reference
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, g)]
    b64 = [b.detach().double().requires_grad_(b.requires_grad) for b in biases]
    out64 = evoformer_attention_reference(*leaves[:3], b64, gate=leaves[3], compute_dtype=torch.float64)
    want = (out64, *torch.autograd.grad(out64, leaves + [b for b in b64 if b.requires_grad], d_out.double()))
    for name, a, p, w, c in zip(["out", "dq", "dk", "dv", "dgate", "dpair"], got, portable, want, again):
        assert torch.equal(a, c), f"{name}: not bitwise reproducible"
        assert cosine(a, w) >= 0.9998 and rel_l2(a, w) <= 2e-2, f"{name}: rel L2 {rel_l2(a, w)} to float64"
        assert rel_l2(a, p) <= 1e-2, f"{name}: rel L2 {rel_l2(a, p)} to the portable passes"
