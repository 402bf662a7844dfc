"""nn.SparseAttention and the GPT's sparse attention: shapes, the index loss's reach, a training step."""
import pytest
import torch

import warpforge as wf
from warpforge.models.gpt.config import GPTConfig
from warpforge.models.gpt.model import GPT
from warpforge.testing import device_under_test, rel_l2

DEV = device_under_test()
DTYPE = torch.float32


def test_module_matches_dense_when_every_block_is_kept():
    """topk covering every earlier block: SparseAttention computes what Attention computes with the same weights."""
    sparse = wf.nn.SparseAttention(64, 4, 2, block_size=16, topk=8, index_dim=8, max_seq_len=128).to(DEV)
    dense = wf.nn.Attention(64, 4, 2, causal=True, rotary=True, max_seq_len=128).to(DEV)
    dense.load_state_dict({k: v for k, v in sparse.state_dict().items() if not k.startswith("index_")})
    x = torch.randn(2, 70, 64, device=DEV)
    assert rel_l2(sparse(x), dense(x)) <= 1e-5


def test_index_loss_trains_the_index_projections_only():
    m = wf.nn.SparseAttention(64, 4, 2, block_size=16, topk=1, index_dim=8, max_seq_len=128).to(DEV)
    x = torch.randn(1, 64, 64, device=DEV, requires_grad=True)
    m(x)
    assert m.aux_loss.item() > 0
    m.aux_loss.backward()
    assert m.index_q.weight.grad is not None and m.index_k.weight.grad is not None
    assert m.qkv.weight.grad is None and x.grad is None


def test_eval_has_no_index_loss():
    m = wf.nn.SparseAttention(64, 4, 2, block_size=16, topk=1, index_dim=8).to(DEV)
    with torch.no_grad():
        m(torch.randn(1, 40, 64, device=DEV))
    assert m.aux_loss.item() == 0


@pytest.mark.parametrize("bad, match", [(dict(topk=0), "topk"), (dict(index_dim=12), "index_dim"),
                                        (dict(block_size=48), "block_size")])
def test_bad_arguments(bad, match):
    kw = dict(block_size=16, topk=2, index_dim=8)
    kw.update(bad)
    with pytest.raises(wf.WarpforgeInputError, match=match):
        m = wf.nn.SparseAttention(64, 4, 2, **kw)
        m(torch.randn(1, 32, 64))


def test_gpt_with_sparse_attention_trains_a_step():
    cfg = GPTConfig(seq_len=64, n_layer=2, n_head=4, n_kv_head=2, d_model=64, attention="sparse", sparse_block=16,
                    sparse_topk=2, sparse_index_dim=8)
    model = GPT(cfg).to(DEV)
    idx = torch.randint(0, 256, (2, 64), device=DEV)
    loss = model(idx, idx)
    loss.backward()
    assert torch.isfinite(loss)
    assert model.blocks[0].attn.index_q.weight.grad is not None


@pytest.mark.parametrize("field, value", [("sparse_block", 48), ("sparse_block", 8), ("sparse_topk", 0),
                                          ("sparse_index_dim", 12)])
def test_gpt_config_checks_the_sparse_fields(field, value):
    with pytest.raises(wf.WarpforgeInputError, match=field):
        GPTConfig(seq_len=64, n_layer=1, n_head=4, n_kv_head=2, d_model=64, attention="sparse", **{field: value})
