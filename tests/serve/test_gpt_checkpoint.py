"""The checkpoints `warpforge gpt train` writes (model.safetensors + config.json) load and decode like the GPT's own
generate (greedy), through paged_decode (head dim 64) and through the gathered varlen path (head dim 32)."""
from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

from warpforge.models.gpt.checkpoint import export_weights
from warpforge.models.gpt.config import GPTConfig
from warpforge.models.gpt.model import GPT
from warpforge.serve import LLM, SamplingParams


@pytest.mark.parametrize("heads", [2, 4])  # head dims 64 and 32
def test_gpt_export_serves_like_gpt_generate(tmp_path, heads):
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=heads, n_kv_head=heads // 2, d_model=128, seq_len=64)
    gpt = GPT(cfg).eval()
    with torch.no_grad():
        for p in gpt.parameters():
            p.normal_(0, 0.1) if p.dim() == 2 else p.uniform_(0.5, 1.5)
    export_weights(tmp_path, gpt.state_dict(), asdict(cfg), "test", 0)
    llm = LLM(tmp_path, page_size=8, num_pages=64, max_num_batched_tokens=16)
    assert llm.spec.model_type == "warpforge_gpt" and llm.max_model_len == 64
    prompts = ["ROMEO.", "What light through yonder window", "a"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([list(prompt.encode())])
        want = gpt.generate(ids, 10, temperature=0.0)[0, ids.shape[1]:].tolist()
        assert out.token_ids == want
        assert out.text == bytes(want).decode("utf-8", errors="replace")
    assert llm.cache.allocator.pages_in_use == 0
