"""Greedy outputs of warpforge.serve.LLM token-identical to transformers' generate(do_sample=False), several prompts
of different lengths in one continuous batch (chunked prefill, mixed prefill / decode steps)."""
from __future__ import annotations

import pytest


from warpforge.serve import LLM, SamplingParams

from conftest import PROMPTS, hf_greedy, make_checkpoint, paged_plan_calls

MAX_NEW = 10


def _check(folder, **llm_kw):
    llm = LLM(folder, **llm_kw)
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    outs = llm.generate(ids, SamplingParams(max_tokens=MAX_NEW, temperature=0))
    assert [o.token_ids for o in outs] == hf_greedy(folder, ids, MAX_NEW)
    assert llm.metrics.max_batch > 1  # the requests really ran together
    assert llm.cache.allocator.pages_in_use == 0 and llm.cache.allocator.check_no_leaks()
    return llm


def test_llama_greedy_matches_transformers(llama_dir):
    # a 16-token budget: the 35-token prompt prefills in chunks beside the others' decode steps
    _check(llama_dir, page_size=8, num_pages=64, max_num_batched_tokens=16)


def test_qwen3_greedy_matches_transformers(qwen3_dir):
    _check(qwen3_dir, page_size=16, num_pages=32, max_num_batched_tokens=64)


def test_chunked_prefill_over_pages_of_one_token(qwen3_dir):
    _check(qwen3_dir, page_size=1, num_pages=256, max_num_batched_tokens=7)


@pytest.mark.parametrize("family,extra", [("qwen2", {}), ("mistral", {"sliding_window": 6})])
def test_qwen2_and_mistral_sliding_window(tmp_path, family, extra):
    make_checkpoint(tmp_path, family, layers=1, seed=3, **extra)
    _check(tmp_path, page_size=8, num_pages=64, max_num_batched_tokens=16)


def test_mistral_layer_types_window_only_their_sliding_layers(tmp_path):
    # what transformers loads as Ministral (it used to window every layer here)
    make_checkpoint(tmp_path, "mistral", layers=2, seed=3, sliding_window=6,
                    layer_types=["full_attention", "sliding_attention"])
    _check(tmp_path, page_size=8, num_pages=64, max_num_batched_tokens=16)


@pytest.mark.parametrize("model_type,cfg,want", [
    ("mistral", {}, (4096,) * 3),                       # MistralConfig's default window
    ("mistral", {"sliding_window": None}, (None,) * 3),
    # transformers' Llama attention ignores the key (its generate's cache does not: that is transformers' own
    # disagreement; warpforge follows the model)
    ("llama", {"sliding_window": 5}, (None,) * 3),
    ("qwen2", {"sliding_window": 5, "use_sliding_window": True}, (None,) * 28 + (5, 5)),  # max_window_layers 28
    ("qwen3", {"sliding_window": 5, "use_sliding_window": False}, (None,) * 3),
])
def test_sliding_window_defaults(model_type, cfg, want):
    from warpforge.serve.loader import _sliding_windows
    assert _sliding_windows(cfg, model_type, len(want)) == want


def test_config_defaults_as_transformers_reads_them(tmp_path):
    """Qwen3's head_dim defaults to 128 (not hidden / heads); Mistral's attention has no biases whatever
    attention_bias says."""
    import json

    from warpforge.serve.loader import read_spec
    base = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2)
    for model_type, extra, check in (("qwen3", {}, lambda s: s.head_dim == 128),
                                     ("mistral", {"attention_bias": True}, lambda s: not s.qkv_bias),
                                     ("llama", {"attention_bias": True}, lambda s: s.qkv_bias)):
        (tmp_path / "config.json").write_text(json.dumps(dict(base, model_type=model_type, **extra)))
        assert check(read_spec(tmp_path)), model_type


@pytest.mark.parametrize("head_dim", [8, 16, 80, 96])
def test_head_dims_that_are_not_powers_of_two_decode_paged(tmp_path, head_dim, monkeypatch):
    # head dims 8 / 16 / 80 / 96 (once gathered K/V through flash_attention): decode steps attend through
    # paged_decode
    make_checkpoint(tmp_path, "llama", layers=1, head_dim=head_dim, seed=4)
    calls = paged_plan_calls(monkeypatch)
    _check(tmp_path, page_size=8, num_pages=64, max_num_batched_tokens=16)
    assert calls and 1 in calls


def test_without_paged_decode_the_varlen_path_gathers(tmp_path, monkeypatch):
    # the fallback kept for head dims the paged op does not take (above 256): every sequence attends through
    # flash_attention over K/V gathered from the pages
    make_checkpoint(tmp_path, "llama", layers=1, head_dim=16, seed=4)
    calls = paged_plan_calls(monkeypatch)
    from warpforge.serve import cuda_graphs
    monkeypatch.setattr(cuda_graphs, "paged_ok", lambda model, cache: False)
    _check(tmp_path, page_size=8, num_pages=64, max_num_batched_tokens=16)
    assert not calls


def test_llama_attention_bias_applies_o_proj_bias(tmp_path):
    # transformers' Llama with attention_bias=True biases q, k, v and o_proj
    make_checkpoint(tmp_path, "llama", layers=1, hidden=32, heads=2, kv_heads=1, head_dim=16, seed=5,
                    attention_bias=True)
    _check(tmp_path, page_size=8, num_pages=64, max_num_batched_tokens=16)


def test_checkpoint_tensors_left_unused_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    from warpforge import WarpforgeInputError
    make_checkpoint(tmp_path, "llama", layers=1, hidden=32, heads=2, kv_heads=1, head_dim=16, seed=5)
    f = tmp_path / "model.safetensors"
    t = load_file(str(f))
    t["model.layers.0.mlp.down_proj.bias"] = t["model.norm.weight"].clone()
    save_file(t, str(f), metadata={"format": "pt"})
    with pytest.raises(WarpforgeInputError, match=r"weights: .*model\.layers\.0\.mlp\.down_proj\.bias"):
        LLM(tmp_path, page_size=8, num_pages=8)
