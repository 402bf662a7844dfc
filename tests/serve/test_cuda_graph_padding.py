"""CUDA-graph decode's static batch on the CPU (capture itself is GPU-only): padding rows write nothing (slot -1),
so a bucket larger than the step runs, and the replayed buffers give the eager step's logits."""
from __future__ import annotations

import torch

from warpforge.serve import LLM, SamplingParams
from warpforge.serve.batch import SeqWork, StepBatch
from warpforge.serve.cuda_graphs import DecodeGraphs


def test_padded_static_batch_runs_and_matches_eager(llama_dir):
    llm = LLM(llama_dir, page_size=8, num_pages=32, cuda_graphs=False)
    model, cache, eng = llm.model, llm.cache, llm.engine
    graphs = DecodeGraphs(model, cache, max_batch=4, max_pages_per_seq=8)
    # the eager warm-up of bucket 4 with every row padding (before: 4 tokens to the scratch slot were refused)
    st = graphs.static_batch(4)
    assert st.slots.tolist() == [-1] * 4
    model.forward(st, cache)
    # two decoding requests in bucket 4: the two padding rows must not collide nor write anywhere
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for p in ([5, 6, 7], [9, 10, 11, 12, 13]):
        eng.add_request(prompt_token_ids=p, params=params)
    eng.step()
    eng.step()
    works = [SeqWork(r.id, [r.tokens[-1]], r.num_computed, "last") for r in eng.running]
    assert len(works) == 2
    for w in works:
        llm.cache.allocator.reserve(w.seq_id, w.start + 1)
    eager = model.forward(StepBatch(works, cache.allocator, model.device), cache)
    k_before = cache.k.clone()
    st = graphs.static_batch(4)  # a bucket of 4 for a step of 2
    assert graphs.fill(st, works, cache.allocator)
    assert st.slots.tolist()[2:] == [-1, -1]
    replayed = model.forward(st, cache)[:2]
    torch.testing.assert_close(replayed, eager)
    real = st.slots[:2].tolist()
    flat_k, flat_before = cache.k.flatten(1, 2), k_before.flatten(1, 2)  # [layers, slots, h_kv, d]
    others = [s for s in range(flat_k.shape[1]) if s not in real]
    assert torch.equal(flat_k[:, others], flat_before[:, others])  # padding wrote nothing (the scratch page neither)
    torch.testing.assert_close(flat_k[:, real], flat_before[:, real])
