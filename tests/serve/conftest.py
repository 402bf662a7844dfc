"""Tiny checkpoints for the serving tests, written once per session: a byte-level BPE tokenizer trained on a few
lines, and random-initialised transformers models (Llama, Qwen3, Qwen2, Mistral) saved with save_pretrained."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the serving tests compare against transformers "
                                   "(pip install -e '.[hf]')")
tokenizers = pytest.importorskip("tokenizers")

TEXT = ["the quick brown fox jumps over the lazy dog", "a paged cache holds keys and values in pages",
        "speculative decoding drafts tokens and verifies them in one step", "hello world, hello serving",
        "continuous batching lets requests join and leave between steps"] * 4
VOCAB = 320
EOS = 1
PROMPTS = ["the quick brown", "hello", "a paged cache holds keys and values in pages and the quick brown fox",
           "speculative decoding drafts tokens"]


def _tokenizer(folder):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TEXT, trainer)
    tok.save(str(folder / "tokenizer.json"))
    return tok


def make_checkpoint(folder, family="llama", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=64, seed=0,
                    **extra):
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, eos_token_id=EOS,
                  bos_token_id=0, max_position_embeddings=256, **extra)
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[family]
    model = cls[1](cls[0](**common)).eval()
    with torch.no_grad():  # larger weights than the init's 0.02: logits far apart, so fp32 argmaxes are stable
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.1)
    model.save_pretrained(folder)
    _tokenizer(folder)
    return model


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    make_checkpoint(d, "llama", rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
                    rope_theta=50000.0, tie_word_embeddings=True)
    return d


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3")
    make_checkpoint(d, "qwen3", seed=1)
    return d


@pytest.fixture(scope="session")
def small_llama_dir(tmp_path_factory):
    """A smaller model of the same vocabulary: a draft model."""
    d = tmp_path_factory.mktemp("llama_small")
    make_checkpoint(d, "llama", layers=1, heads=2, kv_heads=1, seed=2)
    return d


def hf_greedy(folder, prompt_ids, max_new_tokens):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    outs = []
    for ids in prompt_ids:
        with torch.no_grad():
            got = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_new_tokens,
                                 eos_token_id=EOS, pad_token_id=EOS)
        outs.append(got[0, len(ids):].tolist())
    return outs


def paged_plan_calls(monkeypatch):
    """The s_q of every paged.plan the serving forward makes."""
    from warpforge.ops import paged
    calls = []
    real = paged.plan

    def plan(q, *args, **kw):
        calls.append(q.shape[1])
        return real(q, *args, **kw)
    monkeypatch.setattr(paged, "plan", plan)
    return calls
