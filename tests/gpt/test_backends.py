"""GPT(cfg, backend=...) swaps every hot op, MLA and MoE included; the nn modules it is built from."""
import pytest
import torch

import warpforge as wf
from warpforge import WarpforgeInputError
from warpforge.models.gpt import GPT, GPTConfig
from warpforge.nn import functional

from .conftest import SMALL, twins

MLA_MOE = GPTConfig(seq_len=32, n_layer=2, n_head=16, n_kv_head=16, d_model=64, attention="mla", mla_head_dim=16,
                    moe_experts=4, moe_topk=2, moe_ffn_dim=32)
# every warpforge op the nn modules reach, by the module attribute nn.functional calls it through
WARPFORGE_OPS = [(functional.attention_op, "flash_attention"), (functional.norm, "rms_norm"),
                 (functional.norm, "add_rms_norm"), (functional.rope_op, "apply_rope"),
                 (functional.swiglu_op, "swiglu"), (functional.linear_ce, "linear_cross_entropy"),
                 (functional.moe, "route"), (functional.moe, "experts"), (functional.mla, "mla_decode")]


def _count_warpforge_calls(monkeypatch):
    """Counts calls of each warpforge op by name (they still run)."""
    calls = {}
    for module, name in WARPFORGE_OPS:
        fn = getattr(module, name)

        def counted(*args, _fn=fn, _name=name, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _fn(*args, **kwargs)
        monkeypatch.setattr(module, name, counted)
    return calls


def _train_step_and_decode(model):
    x = torch.randint(0, 256, (2, 32))
    model(x, x.roll(-1, 1)).backward()
    model.eval()
    return model.generate(x[:, :5], 4, temperature=0)


@pytest.mark.parametrize("cfg", [SMALL, MLA_MOE], ids=["dense", "mla-moe"])
def test_torch_backend_runs_no_warpforge_op(cfg, monkeypatch):
    calls = _count_warpforge_calls(monkeypatch)
    torch.manual_seed(0)
    _train_step_and_decode(GPT(cfg, backend="torch"))
    assert calls == {}


@pytest.mark.parametrize("cfg", [SMALL, MLA_MOE], ids=["dense", "mla-moe"])
def test_default_backend_runs_warpforge_ops_everywhere(cfg, monkeypatch):
    calls = _count_warpforge_calls(monkeypatch)
    torch.manual_seed(0)
    _train_step_and_decode(GPT(cfg))
    expected = {"flash_attention", "rms_norm", "add_rms_norm", "apply_rope", "swiglu", "linear_cross_entropy"}
    if cfg.attention == "mla":
        expected |= {"route", "experts", "mla_decode"}
    assert set(calls) == expected


def test_dict_backend_swaps_one_op(monkeypatch):
    calls = _count_warpforge_calls(monkeypatch)
    torch.manual_seed(0)
    _train_step_and_decode(GPT(SMALL, backend={"*": "torch", "rms_norm": None}))
    assert set(calls) == {"rms_norm"}


def test_backends_agree_on_mla_and_moe():
    ours, plain = twins(MLA_MOE)
    x = torch.randint(0, 256, (2, 32))
    torch.testing.assert_close(ours(x, x), plain(x, x), rtol=1e-4, atol=1e-4)
    assert torch.equal(ours.eval().generate(x[:, :4], 8, temperature=0),
                       plain.eval().generate(x[:, :4], 8, temperature=0))


@pytest.mark.parametrize("backend", ["tritn", {"atention": None}, {"*": "cuda"}])
def test_bad_backend_fails_at_construction(backend):
    with pytest.raises(WarpforgeInputError, match="^backend"):
        GPT(SMALL, backend=backend)


def test_state_dict_names_are_the_checkpoints():
    """Checkpoints written before the model was built from warpforge.nn load as they are."""
    names = set(GPT(SMALL).state_dict())
    block = {"norm1.weight", "attn.qkv.weight", "attn.proj.weight", "norm2.weight", "mlp.gate_up.weight",
             "mlp.down.weight"}
    assert names == {"embed.weight", "head.weight", "norm.weight"} | {f"blocks.{i}.{n}" for i in range(2)
                                                                       for n in block}


def test_rms_norm_module_fuses_the_residual_and_writes_autocasts_dtype():
    norm = wf.nn.RMSNorm(64)
    norm.weight.data.uniform_(0.5, 1.5)
    x, r = torch.randn(3, 64), torch.randn(3, 64)
    y, total = norm(x, r)
    torch.testing.assert_close(total, x + r)
    torch.testing.assert_close(y, norm(x + r))
    torch.testing.assert_close(y, torch.nn.functional.rms_norm(x + r, (64,), norm.weight, 1e-6))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert norm(x).dtype == torch.bfloat16
        y, total = norm(x, r)
    assert y.dtype == torch.bfloat16 and total.dtype == torch.float32


def test_swiglu_module():
    mlp = wf.nn.SwiGLU(32, 48, backend="torch")
    x = torch.randn(5, 32)
    gate, up = mlp.gate_up(x).chunk(2, -1)
    torch.testing.assert_close(mlp(x), mlp.down(torch.nn.functional.silu(gate) * up))
    ours = wf.nn.SwiGLU(32, 48)
    ours.load_state_dict(mlp.state_dict())
    torch.testing.assert_close(ours(x), mlp(x))


MONARCH = GPTConfig(seq_len=32, n_layer=2, n_head=2, n_kv_head=2, d_model=64, mlp="monarch", monarch_blocks=4)


def test_monarch_mlp_model_trains_and_decodes_on_every_backend(monkeypatch):
    """mlp="monarch": both feed-forward projections are MonarchLinear layers; the backends compute one model."""
    ours, plain = twins(MONARCH)
    assert isinstance(ours.blocks[0].mlp.gate_up, wf.nn.MonarchLinear)
    assert isinstance(ours.blocks[0].mlp.down, wf.nn.MonarchLinear)
    dense = GPT(GPTConfig(seq_len=32, n_layer=2, n_head=2, n_kv_head=2, d_model=64))
    assert ours.num_params() < dense.num_params()
    x = torch.randint(0, 256, (2, 32))
    torch.testing.assert_close(ours(x, x), plain(x, x), rtol=1e-4, atol=1e-4)
    calls = []
    real = functional.monarch.monarch_linear
    monkeypatch.setattr(functional.monarch, "monarch_linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    _train_step_and_decode(ours)
    assert calls
    calls.clear()
    _train_step_and_decode(plain)
    assert not calls


def test_monarch_mlp_settings_are_checked():
    with pytest.raises(WarpforgeInputError, match="^mlp"):
        GPTConfig(mlp="butterfly")
    with pytest.raises(WarpforgeInputError, match="^d_model"):
        GPTConfig(d_model=66, n_head=6, n_kv_head=6, mlp="monarch", monarch_blocks=4)
