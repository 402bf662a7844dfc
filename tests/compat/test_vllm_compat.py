"""warpforge.compat.vllm: vLLM's fused_moe call against warpforge.fused_moe and the reference on both backends,
the tuned-config directory (WARPFORGE_MOE_CONFIG_DIR), and bad input named."""
import json
import logging

import pytest
import torch

import warpforge as wf
from warpforge import WarpforgeInputError
from warpforge.compat import vllm
from warpforge.ops.moe import api as moe_api
from warpforge.ops.moe import configs as moe_configs
from warpforge.ops.moe import fused_moe_reference, quantize_weights
from warpforge.testing import REL_L2, device_under_test, dtypes_under_test, poisoned_outputs, rel_l2

DEV = device_under_test()
DTYPE = dtypes_under_test()[-1]
BACKENDS = ["triton", "reference"]
E, H, I, T, K = 4, 32, 40, 7, 2


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("WARPFORGE_BACKEND", request.param)  # vLLM's call takes no backend argument
    return request.param


@pytest.fixture(autouse=True)
def _no_config_dir(monkeypatch):
    monkeypatch.delenv(vllm.ENV, raising=False)
    vllm.clear_config_cache()
    yield
    vllm.clear_config_cache()


def _problem(t=T, dtype=DTYPE):
    h = torch.randn(t, H, device=DEV, dtype=dtype)
    w1 = torch.randn(E, 2 * I, H, device=DEV, dtype=dtype) / H ** 0.5
    w2 = torch.randn(E, H, I, device=DEV, dtype=dtype) / I ** 0.5
    g = torch.randn(t, E, device=DEV, dtype=dtype)
    return h, w1, w2, g


def test_issue_call_positional_renormalize(backend):
    """The issue's line: fused_moe(h, w1, w2, g, topk, True), vLLM's positional renormalize."""
    h, w1, w2, g = _problem()
    with poisoned_outputs():
        out = vllm.fused_moe(h, w1, w2, g, K, True)
    assert torch.equal(out, wf.fused_moe(h, w1, w2, g, K, renormalize=True))
    ref = fused_moe_reference(h.float(), w1.float(), w2.float(), g.float(), K, renormalize=True)
    assert out.dtype == DTYPE and rel_l2(out, ref) <= REL_L2[DTYPE]
    out_plain = vllm.fused_moe(h, w1, w2, g, K, False)
    assert torch.equal(out_plain, wf.fused_moe(h, w1, w2, g, K, renormalize=False))


def test_inplace_writes_hidden_states(backend):
    h, w1, w2, g = _problem()
    want = vllm.fused_moe(h, w1, w2, g, K, True)
    got = vllm.fused_moe(h, w1, w2, g, K, True, True)
    assert got is h and torch.equal(h, want)


def test_grouped_and_custom_routing(backend):
    h, w1, w2, g = _problem()
    got = vllm.fused_moe(h, w1, w2, g, K, True, use_grouped_topk=True, num_expert_group=2, topk_group=1)
    assert torch.equal(got, wf.fused_moe(h, w1, w2, g, K, renormalize=True, num_expert_group=2, topk_group=1))

    def first_two(hidden, logits, topk, renormalize):  # vLLM's custom_routing_function call
        ids = torch.arange(topk, device=DEV, dtype=torch.int32).expand(hidden.shape[0], topk).contiguous()
        return torch.full((hidden.shape[0], topk), 0.5, device=DEV), ids
    got = vllm.fused_moe(h, w1, w2, g, K, True, custom_routing_function=first_two)
    weights, ids = first_two(h, g, K, True)
    assert torch.equal(got, wf.moe.experts(h, w1, w2, weights, ids))


def test_fp8_block_and_per_expert_scales(backend):
    h, w1, w2, g = _problem(t=5)
    q1, s1 = quantize_weights(w1)
    q2, s2 = quantize_weights(w2)
    want = wf.fused_moe(h, q1, q2, g, K, renormalize=True, w_format="fp8", w_scales=(s1, s2))
    got = vllm.fused_moe(h, q1, q2, g, K, True, use_fp8_w8a8=True, w1_scale=s1, w2_scale=s2, block_shape=[128, 128])
    assert torch.equal(got, want)
    # one scale per expert (vLLM's per-tensor FP8 checkpoints): the same as that scale in every block
    e1 = (w1.float().abs().amax(dim=(1, 2)) / 448.0)
    e2 = (w2.float().abs().amax(dim=(1, 2)) / 448.0)
    p1 = (w1.float() / e1[:, None, None]).to(torch.float8_e4m3fn)
    p2 = (w2.float() / e2[:, None, None]).to(torch.float8_e4m3fn)
    got = vllm.fused_moe(h, p1, p2, g, K, True, use_fp8_w8a8=True, w1_scale=e1, w2_scale=e2)
    blocks = (e1[:, None, None].expand_as(s1).contiguous(), e2[:, None, None].expand_as(s2).contiguous())
    assert torch.equal(got, wf.fused_moe(h, p1, p2, g, K, renormalize=True, w_format="fp8", w_scales=blocks))
    ref = fused_moe_reference(h.float(), p1.float() * e1[:, None, None], p2.float() * e2[:, None, None], g.float(), K)
    assert rel_l2(got, ref) <= REL_L2[DTYPE]


# ------------------------------------------------------------------------------------------ config dir
def _entry(bm, bn, bk):
    return {"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": bn, "BLOCK_SIZE_K": bk, "GROUP_SIZE_M": 1, "num_warps": 4,
            "num_stages": 2}


def test_config_file_name_like_vllm():
    cpu = torch.device("cpu")
    assert vllm.get_config_file_name(8, 14336, device=cpu) == "E=8,N=14336,device_name=cpu.json"
    assert vllm.get_config_file_name(256, 2048, "fp8_w8a8", [128, 128], device=cpu) == \
        "E=256,N=2048,device_name=cpu,dtype=fp8_w8a8,block_shape=[128,128].json"


def test_config_dir_is_read_and_nearest_token_count_used(tmp_path, monkeypatch):
    h, w1, w2, g = _problem()
    name = vllm.get_config_file_name(E, I, "float32" if DTYPE == torch.float32 else None, device=DEV)
    (tmp_path / name).write_text(json.dumps({"1": _entry(32, 16, 16), "64": _entry(16, 64, 32),
                                             "triton_version": "3.x"}))
    monkeypatch.setenv(vllm.ENV, str(tmp_path))
    monkeypatch.setenv("WARPFORGE_BACKEND", "triton")
    small = moe_configs.MoECfg(32, moe_configs.GemmTile(16, 16, 4, 2), moe_configs.GemmTile(16, 16, 4, 2))
    large = moe_configs.MoECfg(16, moe_configs.GemmTile(64, 32, 4, 2), moe_configs.GemmTile(64, 32, 4, 2))
    assert moe_api._config(DEV, T, w1) == small and moe_api._config(DEV, 40, w1) == large

    class NoTable:  # the built-in table must not be asked
        def lookup(self, *a, **kw):
            raise AssertionError("built-in table used")
    monkeypatch.setattr(moe_configs, "GEMMS", NoTable())
    with poisoned_outputs():
        out = vllm.fused_moe(h, w1, w2, g, K, True)
    ref = fused_moe_reference(h.float(), w1.float(), w2.float(), g.float(), K)
    assert rel_l2(out, ref) <= REL_L2[DTYPE]


def test_one_log_line_when_the_built_in_table_is_used(tmp_path, monkeypatch, caplog):
    h, w1, w2, g = _problem()
    monkeypatch.setenv("WARPFORGE_BACKEND", "triton")
    name = vllm.get_config_file_name(E, I, "float32" if DTYPE == torch.float32 else None, device=DEV)
    with caplog.at_level(logging.INFO, logger="warpforge.compat.vllm"):
        for _ in range(2):
            vllm.fused_moe(h, w1, w2, g, K, True)
    assert [r.levelno for r in caplog.records if name in r.getMessage()] == [logging.INFO]
    caplog.clear()
    monkeypatch.setenv(vllm.ENV, str(tmp_path))  # a directory without the file: a warning, once
    with caplog.at_level(logging.INFO, logger="warpforge.compat.vllm"):
        for _ in range(2):
            vllm.fused_moe(h, w1, w2, g, K, True)
    assert [r.levelno for r in caplog.records if name in r.getMessage()] == [logging.WARNING]


def test_bad_config_file_is_named(tmp_path, monkeypatch):
    h, w1, w2, g = _problem()
    name = vllm.get_config_file_name(E, I, "float32" if DTYPE == torch.float32 else None, device=DEV)
    (tmp_path / name).write_text(json.dumps({"16": _entry(16, 48, 16)}))
    monkeypatch.setenv(vllm.ENV, str(tmp_path))
    monkeypatch.setenv("WARPFORGE_BACKEND", "triton")
    with pytest.raises(WarpforgeInputError, match=r"BLOCK_SIZE_N: expected one of"):
        vllm.fused_moe(h, w1, w2, g, K, True)
    (tmp_path / name).write_text("{not json")
    with pytest.raises(WarpforgeInputError, match=name.replace("[", r"\[")):
        vllm.fused_moe(h, w1, w2, g, K, True)


# ------------------------------------------------------------------------------------------ bad input
def _raises(name, fn):
    with pytest.raises(WarpforgeInputError, match=rf"^{name}"):
        fn()


def test_bad_input_names_the_argument():
    h, w1, w2, g = _problem()
    call = vllm.fused_moe
    _raises("activation", lambda: call(h, w1, w2, g, K, True, activation="gelu"))
    _raises("use_int8_w8a16", lambda: call(h, w1, w2, g, K, True, use_int8_w8a16=True))
    _raises("per_channel_quant", lambda: call(h, w1, w2, g, K, True, per_channel_quant=True))
    _raises("expert_map", lambda: call(h, w1, w2, g, K, True, expert_map=torch.arange(E)))
    _raises("global_num_experts", lambda: call(h, w1, w2, g, K, True, global_num_experts=16))
    _raises("a1_scale", lambda: call(h, w1, w2, g, K, True, a1_scale=torch.ones(1)))
    _raises("w1_scale", lambda: call(h, w1, w2, g, K, True, w1_scale=torch.ones(E)))
    _raises("renormalize", lambda: call(h, w1, w2, g, K, 1))
    _raises("num_expert_group", lambda: call(h, w1, w2, g, K, True, use_grouped_topk=True))
    _raises("topk", lambda: call(h, w1, w2, g, E + 1, True))
    _raises("gating_output", lambda: call(h, w1, w2, g[:, :3], K, True))
    _raises("w1", lambda: call(h, w1[:, :5], w2, g, K, True))
    q1, s1 = quantize_weights(w1)
    q2, s2 = quantize_weights(w2)
    _raises("block_shape", lambda: call(h, q1, q2, g, K, True, use_fp8_w8a8=True, w1_scale=s1, w2_scale=s2,
                                        block_shape=[64, 64]))
    _raises("w2_scale", lambda: call(h, q1, q2, g, K, True, use_fp8_w8a8=True, w1_scale=s1, w2_scale=s2[:, :, :0],
                                     block_shape=[128, 128]))
    _raises("w2_scale", lambda: call(h, q1, q2, g, K, True, use_fp8_w8a8=True, w1_scale=s1))
