"""The one-launch decode kernel (ops/moe/decode_kernel.py): taken where configs.DECODE says, right against the
reference in bf16/fp16 and FP8, its workspace zero again after every call, ids out of range adding nothing."""
import pytest
import torch

import warpforge as wf
from warpforge.ops.moe import (api, configs, decode_kernel, dequantize_weights_reference, experts_reference,
                               route_reference)

from .test_fused_moe import _weights, check_fp8_weights
from warpforge.testing import REL_L2, device_under_test, dtypes_under_test, poisoned_outputs, rel_l2

DEV = device_under_test()
DTYPE = dtypes_under_test()[-1]
TILE = configs.DecodeTile(16, 32, 32, 1, 1) if DEV.type != "cuda" else configs.DecodeTile(32, 64, 64, 4, 3)


@pytest.fixture
def decode_path(monkeypatch):
    """The decode kernel at every T (this file's tile), its calls counted."""
    monkeypatch.setattr(configs, "DECODE", configs.DECODE.map(lambda _: TILE))
    calls = []
    real = decode_kernel.fused_experts_decode
    monkeypatch.setattr(decode_kernel, "fused_experts_decode", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


def _workspaces_zero():
    return all(not w.any() and not c.any() for w, c in decode_kernel._WORKSPACES.values())


@pytest.mark.parametrize("t,e,k,h,i", [
    (1, 8, 2, 64, 96),      # one token
    (3, 16, 4, 80, 48),     # H and I not multiples of the tiles
    (5, 4, 4, 32, 40),      # topk = E: tokens sharing every expert
])
def test_matches_reference(decode_path, t, e, k, h, i):
    hidden = torch.randn(t, h, device=DEV, dtype=DTYPE)
    logits = torch.randn(t, e, device=DEV)
    w13, w2 = _weights(e, h, i)
    ref = wf.fused_moe(hidden.float(), w13.float(), w2.float(), logits, k, backend="reference")
    for _ in range(3):  # the workspace and counter are back to zero after each call
        with poisoned_outputs():
            out = wf.fused_moe(hidden, w13, w2, logits, k, backend="triton")
        assert out.dtype == hidden.dtype and rel_l2(out, ref) <= REL_L2[DTYPE]
        assert _workspaces_zero()
    assert len(decode_path) == 3


def test_fp8_weights(decode_path):
    check_fp8_weights(2, 8, 2, 160, 96)
    assert decode_path


def test_ids_out_of_range_add_nothing(decode_path):
    """experts(check_ids=False) with an id past E: that slot adds nothing, the rest are summed, and the workspace
    still ends at zero (the slot's programs count themselves done)."""
    t, e, k, h, i = 2, 4, 2, 32, 48
    hidden = torch.randn(t, h, device=DEV, dtype=DTYPE)
    w13, w2 = _weights(e, h, i)
    ids = torch.tensor([[0, 7], [2, 1]], device=DEV, dtype=torch.int32)
    weights = torch.rand(t, k, device=DEV)
    out = wf.moe.experts(hidden, w13, w2, weights, ids, check_ids=False, backend="triton")
    keep = torch.tensor([[1.0, 0.0], [1.0, 1.0]], device=DEV)
    ref = experts_reference(hidden.float(), w13.float(), w2.float(), weights * keep, ids.clamp(max=e - 1))
    assert decode_path and rel_l2(out, ref) <= REL_L2[DTYPE] and _workspaces_zero()


def test_training_and_switch_off_keep_the_gathered_path(decode_path, monkeypatch):
    t, e, k, h, i = 2, 4, 2, 32, 48
    hidden = torch.randn(t, h, device=DEV, dtype=DTYPE, requires_grad=True)
    w13, w2 = _weights(e, h, i)
    wf.fused_moe(hidden, w13, w2, torch.randn(t, e, device=DEV), k, backend="triton").sum().backward()
    monkeypatch.setenv("WARPFORGE_MOE_DECODE", "0")
    with torch.no_grad():
        wf.fused_moe(hidden, w13, w2, torch.randn(t, e, device=DEV), k, backend="triton")
    assert not decode_path


def test_switch_on_takes_the_try_tile(monkeypatch):
    monkeypatch.setattr(configs, "DECODE", configs.DECODE.map(lambda _: None))
    w13 = torch.empty(4, 64, 32)
    assert api._decode_tile(DEV, 1, w13) is None
    monkeypatch.setenv("WARPFORGE_MOE_DECODE", "1")
    assert api._decode_tile(DEV, 16, w13) == configs.DECODE_TRY and api._decode_tile(DEV, 17, w13) is None


def test_fp8_weights_skip_a_bf16_only_tile(monkeypatch):
    """A tile with fp8=False (DeepSeek-V3's on sm90) serves bf16 weights only; FP8 ones keep the gathered path."""
    monkeypatch.setattr(configs, "DECODE", configs.DECODE.map(lambda _: TILE._replace(fp8=False)))
    w13 = torch.empty(4, 64, 32)
    assert api._decode_tile(DEV, 1, w13) is not None and api._decode_tile(DEV, 1, w13, fp8=True) is None


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 4, 16])
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_qwen3_like_in_a_cuda_graph(t, fp8, monkeypatch):
    """The try tile at Qwen3-30B-A3B's expert shape, replayed from a CUDA graph several times on new inputs: the
    workspace captured with the graph must come back to zero after every replay."""
    monkeypatch.setenv("WARPFORGE_MOE_DECODE", "1")
    e, k, h, i = 128, 8, 2048, 768
    w13, w2 = _weights(e, h, i, torch.bfloat16)
    kw = {}
    if fp8:
        (w13, s13), (w2, s2) = wf.moe.quantize_weights(w13), wf.moe.quantize_weights(w2)
        kw = dict(w_format="fp8", w_scales=(s13, s2))
    hidden = torch.randn(t, h, device=DEV, dtype=torch.bfloat16)
    logits = torch.randn(t, e, device=DEV)
    wf.fused_moe(hidden, w13, w2, logits, k, **kw)  # compiled, workspace made, outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = wf.fused_moe(hidden, w13, w2, logits, k, **kw)
    for _ in range(3):
        hidden.copy_(torch.randn_like(hidden))
        logits.copy_(torch.randn_like(logits))
        graph.replay()
        deq = (dequantize_weights_reference(w13, s13), dequantize_weights_reference(w2, s2)) if fp8 else (w13, w2)
        ref = experts_reference(hidden.float(), deq[0].float(), deq[1].float(), *route_reference(logits, k))
        assert rel_l2(out, ref) <= 1e-2
        assert _workspaces_zero()
