"""The serving path on a GPU: the Triton kernels (varlen flash prefill, paged decode, norms, RoPE, SwiGLU), fp32
parity with transformers, CUDA-graph decode token-identical to eager decode, speculative greedy identical to
plain greedy in bf16."""
from __future__ import annotations

import pytest
import torch

from warpforge.serve import LLM, SamplingParams

from conftest import PROMPTS, hf_greedy

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _ids(llm):
    return [llm.tokenizer.encode(p) for p in PROMPTS]


def test_fp32_on_gpu_matches_transformers(llama_dir):
    llm = LLM(llama_dir, device="cuda", dtype="float32", page_size=8, num_pages=64, max_num_batched_tokens=16)
    outs = llm.generate(_ids(llm), SamplingParams(max_tokens=10, temperature=0))
    assert [o.token_ids for o in outs] == hf_greedy(llama_dir, _ids(llm), 10)


@pytest.mark.parametrize("kv_format,fp4_layout,gluon_nvfp4_pair", [
    ("bf16", None, False), ("fp8", None, False), ("nvfp4", "rows", False), ("mxfp4", "rows", False),
    ("nvfp4", "pair", False), ("mxfp4", "pair", False),
    # the NVFP4 pair on the Gluon kernel, held back by default (paged/api.nvfp4_pair_held_back): session 42's open
    # bug (a wrong output under graph replay), expected to fail until it is found
    pytest.param("nvfp4", "pair", True, marks=pytest.mark.xfail(reason="the NVFP4 pair on the Gluon kernel under CUDA "
                                                                      "graphs: NOTES session 42", strict=False))])
def test_cuda_graph_decode_is_eager_decode(tmp_path, kv_format, fp4_layout, gluon_nvfp4_pair, monkeypatch):
    """head dim 128: the quantised caches take the Hopper Gluon kernel where its gate holds (sm_90)."""
    from conftest import make_checkpoint

    from warpforge.ops.paged import configs
    from warpforge.serve import kv_cache
    qwen3_dir = tmp_path / "qwen3-d128"
    make_checkpoint(qwen3_dir, "qwen3", seed=1, head_dim=128)
    if fp4_layout is not None:
        monkeypatch.setattr(kv_cache, "FP4_LAYOUT", fp4_layout)
    if gluon_nvfp4_pair:
        monkeypatch.setenv(configs.GLUON_NVFP4_PAIR_ENV, "1")
    kw = dict(device="cuda", dtype="bfloat16", kv_format=kv_format, page_size=16, num_pages=64)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    eager = LLM(qwen3_dir, cuda_graphs=False, **kw)
    graphed = LLM(qwen3_dir, cuda_graphs=True, **kw)
    want = [o.token_ids for o in eager.generate(_ids(eager), params)]
    got = [o.token_ids for o in graphed.generate(_ids(graphed), params)]
    assert got == want
    assert graphed.engine.graphs.graphs  # some steps were replayed
    assert graphed.cache.allocator.pages_in_use == 1  # the graphs' scratch page only


def test_speculative_greedy_bf16(llama_dir):
    kw = dict(device="cuda", dtype="bfloat16", page_size=16, num_pages=64)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    plain = LLM(llama_dir, **kw)
    want = [o.token_ids for o in plain.generate(_ids(plain), params)]
    spec = LLM(llama_dir, speculative=str(llama_dir), num_speculative_tokens=4, **kw)
    assert [o.token_ids for o in spec.generate(_ids(spec), params)] == want
    assert spec.metrics.acceptance_rate > 0.9
