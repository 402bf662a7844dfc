"""CUDA-graph replay of plain decode steps (one new token per sequence), one graph per batch-size bucket.

A step's host work (Python, the op checks, a few dozen launches a layer) costs more than the decode's GPU time at
small batches; a replay costs one launch. Each bucket's graph reads static buffers (token ids, positions, cache
slots, block table [bucket, max pages], lengths) that `run` fills before replaying; rows past the step's batch are
padding: their cache slot is -1 (the append op skips it, so padding rows write nothing and never collide) and
their block table points at a scratch page this object reserves, so that their attention reads a page of its own. The
paged op's plan is made at the warm-up before capture, so the captured step reads nothing back to the host.

Captured lazily on first use of a bucket, and only for CUDA devices (`DecodeGraphs.supported`). Steps with
prefill chunks or drafts run eagerly.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from .batch import DecodeGroup

BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)
_SCRATCH = "__cuda_graph_scratch__"


class DecodeGraphs:
    def __init__(self, model, cache, max_batch: int, max_pages_per_seq: int):
        self.model, self.cache = model, cache
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
        self.max_pages = max_pages_per_seq
        self.scratch = cache.allocator.reserve(_SCRATCH, 1)[0]
        self.page_size = cache.page_size
        self.graphs: dict = {}
        self.pool = None  # made at the first capture

    @staticmethod
    def supported(device) -> bool:
        return torch.device(device).type == "cuda" and torch.cuda.is_available()

    def fits(self, n: int) -> bool:
        return n <= self.buckets[-1]

    def static_batch(self, b: int) -> SimpleNamespace:
        """The static step buffers of bucket b, every row padding (slot -1, the scratch page, length 1)."""
        dev = self.model.device
        bt = torch.full((b, self.max_pages), self.scratch, dtype=torch.int32, device=dev)
        lens = torch.ones(b, dtype=torch.int32, device=dev)
        return SimpleNamespace(num_tokens=b, all_logits=True, varlen=None,
                               input_ids=torch.zeros(b, dtype=torch.long, device=dev),
                               positions=torch.zeros(b, dtype=torch.long, device=dev),
                               slots=torch.full((b,), -1, dtype=torch.long, device=dev),
                               logits_index=torch.arange(b, device=dev),
                               decode_groups=[DecodeGroup(1, list(range(b)), None, bt, lens)])

    def _static(self, b: int):
        st = self.static_batch(b)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (plans, autotuning, allocations) off the capturing stream
            for _ in range(2):
                self.model.forward(st, self.cache)
        torch.cuda.current_stream().wait_stream(side)
        st.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(st.graph, pool=self.pool):
            st.logits = self.model.forward(st, self.cache)
        return st

    def bucket(self, n: int) -> int:
        return next(x for x in self.buckets if x >= n)

    def fill(self, st, works: list, alloc) -> bool:
        """Copies a plain decode step of len(works) <= bucket rows into st's buffers (rows past them: padding, slot
        -1); False (nothing copied) if a sequence is longer than the graphs were sized for."""
        n, b = len(works), st.num_tokens
        page = self.page_size
        ids, pos, slots, lens = [], [], [], []
        table = torch.full((b, self.max_pages), self.scratch, dtype=torch.int32)
        for i, w in enumerate(works):
            t = alloc.tables[w.seq_id]
            if len(t) > self.max_pages:
                return False
            ids.append(w.tokens[0])
            pos.append(w.start)
            slots.append(t[w.start // page] * page + w.start % page)
            lens.append(w.start + 1)
            table[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
        pad = b - n
        ids += [0] * pad
        pos += [0] * pad
        slots += [-1] * pad  # skipped by the append: padding writes nothing
        lens += [1] * pad
        st.input_ids.copy_(torch.tensor(ids), non_blocking=True)
        st.positions.copy_(torch.tensor(pos), non_blocking=True)
        st.slots.copy_(torch.tensor(slots), non_blocking=True)
        g = st.decode_groups[0]
        g.block_table.copy_(table, non_blocking=True)
        g.seqlens.copy_(torch.tensor(lens, dtype=torch.int32), non_blocking=True)
        return True

    def run(self, works: list, alloc) -> torch.Tensor:
        """fp32 logits [len(works), vocab] of a plain decode step, by replay (captured on the bucket's first use);
        None when a sequence is longer than the graphs were sized for (the eager path takes it)."""
        n = len(works)
        if any(len(alloc.tables[w.seq_id]) > self.max_pages for w in works):
            return None
        b = self.bucket(n)
        st = self.graphs.get(b)
        if st is None:
            st = self.graphs[b] = self._static(b)
        if not self.fill(st, works, alloc):
            return None
        st.graph.replay()
        return st.logits[:n]
