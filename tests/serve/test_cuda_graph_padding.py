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


def test_padded_verification_batch_matches_eager(llama_dir):
    """A verification step through a graph's static batch (s_q = k + 1 = 5): sequences with 3 and 1 new tokens are
    padded to 5 (padding tokens write nothing); the real rows' logits are the eager step's."""
    llm = LLM(llama_dir, page_size=8, num_pages=32, cuda_graphs=False)
    model, cache, eng = llm.model, llm.cache, llm.engine
    graphs = DecodeGraphs(model, cache, max_batch=4, max_pages_per_seq=8)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for p in ([5, 6, 7], [9, 10, 11, 12, 13, 14, 15]):
        eng.add_request(prompt_token_ids=p, params=params)
    eng.step()
    eng.step()
    r0, r1 = eng.running
    works = [SeqWork(r0.id, [r0.tokens[-1], 3, 4], r0.num_computed, "all"),
             SeqWork(r1.id, [r1.tokens[-1]], r1.num_computed, "last")]
    for w in works:
        cache.allocator.reserve(w.seq_id, w.start + len(w.tokens))
    batch = StepBatch(works, cache.allocator, model.device)
    eager = model.forward(batch, cache)
    k_before = cache.k.clone()
    st = graphs.static_batch(4, 5)
    assert graphs.fill(st, works, cache.allocator)
    slots = st.slots.tolist()
    assert slots[3:5] == [-1, -1] and slots[6:] == [-1] * 14  # the padding tokens and rows
    replayed = model.forward(st, cache)
    rows = [0, 1, 2, 5]  # the first sequence's three rows, the second's one
    torch.testing.assert_close(replayed[rows], eager[torch.cat([torch.arange(3), torch.tensor([3])])])
    real = [s for s in slots if s >= 0]
    flat_k, flat_before = cache.k.flatten(1, 2), k_before.flatten(1, 2)
    others = [s for s in range(flat_k.shape[1]) if s not in real]
    assert torch.equal(flat_k[:, others], flat_before[:, others])
