"""CUDA-graph replay of decode steps, one graph per (batch-size bucket, tokens per sequence): plain decode (one new
token per sequence) and speculative verification or drafting (s_q = k + 1: the pending token and k drafts).

A step's host work (Python, the op checks, a few dozen launches a layer) costs more than the decode's GPU time at
small batches; a replay costs one launch. Each graph reads static buffers (token ids, positions, cache slots, block
table [bucket, max pages], lengths) that `run` fills before replaying. Rows past the step's batch are padding: their
cache slot is -1 (the append op skips it, so padding rows write nothing and never collide) and their block table
points at a scratch page this object reserves, so that their attention reads a page of its own. A sequence with
fewer than s_q new tokens is padded the same way at its end: the padding tokens write nothing, come after its real
ones (so no real query attends to them: attention is causal among a step's tokens), and their logits are not read.
The paged op's plan is made at the warm-up before capture, so the captured step reads nothing back to the host.

Captured lazily on first use of a (bucket, s_q), and only for CUDA devices (`DecodeGraphs.supported`). Steps with
prefill chunks longer than s_q run eagerly.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from ..ops import paged
from ..ops.paged import MAX_S_Q
from .batch import DecodeGroup, StepBatch, cache_slots

BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)
_SCRATCH = ("cuda graph scratch",)  # not a string: no request id (a str, maybe user-named) can take its page


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

    def static_batch(self, b: int, s_q: int = 1) -> SimpleNamespace:
        """The static step buffers of bucket b at s_q tokens per sequence, every row padding (slot -1, the scratch
        page, length s_q)."""
        dev = self.model.device
        bt = torch.full((b, self.max_pages), self.scratch, dtype=torch.int32, device=dev)
        lens = torch.full((b,), s_q, dtype=torch.int32, device=dev)
        n = b * s_q
        return SimpleNamespace(num_tokens=n, all_logits=True, varlen=None, s_q=s_q,
                               input_ids=torch.zeros(n, dtype=torch.long, device=dev),
                               positions=torch.zeros(n, dtype=torch.long, device=dev),
                               slots=torch.full((n,), -1, dtype=torch.long, device=dev),
                               logits_index=torch.arange(n, device=dev),
                               decode_groups=[DecodeGroup(s_q, list(range(b)), None, bt, lens)])

    def capture(self, fn):
        """(graph, fn's output): fn run twice off the capturing stream (plans, autotuning, allocations), then
        captured into the pool every graph of this object shares (a draft chain's too)."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        return graph, out

    def _static(self, b: int, s_q: int):
        st = self.static_batch(b, s_q)
        st.graph, st.logits = self.capture(lambda: self.model.forward(st, self.cache))
        return st

    def bucket(self, n: int) -> int:
        return next(x for x in self.buckets if x >= n)

    def holds(self, works: list, alloc, s_q: int) -> bool:
        """Whether every sequence's pages, and its length padded to s_q, fit the graphs' block table (checked before
        a capture too: its warm-up rows are s_q long, more than the table holds when s_q > max_pages x page)."""
        page = self.page_size
        return all(len(alloc.tables[w.seq_id]) <= self.max_pages and -(-(w.start + s_q) // page) <= self.max_pages
                   for w in works)

    def fill(self, st, works: list, alloc) -> bool:
        """Copies a decode step of len(works) <= bucket sequences, each with 1 to st.s_q new tokens, into st's
        buffers (rows past them, and tokens past a sequence's own: padding, slot -1); False (nothing copied) if a
        sequence is longer than the graphs were sized for."""
        b, s_q = st.decode_groups[0].block_table.shape[0], st.s_q
        if not self.holds(works, alloc, s_q):
            return False
        page = self.page_size
        ids, pos, slots, lens = [], [], [], []
        tables = []
        for w in works:
            t = alloc.tables[w.seq_id]
            n = len(w.tokens)
            ids += w.tokens + [0] * (s_q - n)
            last = w.start + n - 1
            pos += list(range(w.start, last + 1)) + [last] * (s_q - n)  # padding: a position the rotary table has
            slots += cache_slots(t, range(w.start, last + 1), page) + [-1] * (s_q - n)
            lens.append(w.start + s_q)  # the step's s_q tokens are the sequence's last: padding past its pages
            tables.append(t + [self.scratch] * (self.max_pages - len(t)))
        pad = b - len(works)
        ids += [0] * (pad * s_q)
        pos += [0] * (pad * s_q)
        slots += [-1] * (pad * s_q)  # skipped by the append: padding writes nothing
        lens += [s_q] * pad
        tables += [[self.scratch] * self.max_pages] * pad
        st.input_ids.copy_(torch.tensor(ids), non_blocking=True)
        st.positions.copy_(torch.tensor(pos), non_blocking=True)
        st.slots.copy_(torch.tensor(slots), non_blocking=True)
        g = st.decode_groups[0]
        g.block_table.copy_(torch.tensor(tables, dtype=torch.int32), non_blocking=True)
        g.seqlens.copy_(torch.tensor(lens, dtype=torch.int32), non_blocking=True)
        return True

    def run(self, works: list, alloc, s_q: int = 1):
        """(fp32 logits, each work's rows in them) of a decode step whose sequences have 1 to s_q new tokens each,
        by replay (captured on the (bucket, s_q)'s first use); None when a sequence is longer than the graphs were
        sized for (the eager path takes it)."""
        n = len(works)
        if not self.holds(works, alloc, s_q):
            return None
        key = (self.bucket(n), s_q)
        st = self.graphs.get(key)
        if st is None:
            st = self.graphs[key] = self._static(*key)
        if not self.fill(st, works, alloc):
            return None
        st.graph.replay()
        slices = []
        for i, w in enumerate(works):
            end = i * s_q + len(w.tokens)
            slices.append(slice(i * s_q, end) if w.logits == "all" else slice(end - 1, end))
        return st.logits[:n * s_q], slices


def paged_ok(model, cache) -> bool:
    """Whether the paged op takes the model's head dim in the cache's format (else every sequence goes the varlen
    way: flash_attention over K/V gathered from the pages)."""
    return model.spec.head_dim in paged.head_dims(cache.kv_format)


def forward_step(model, cache, works: list, graphs, max_s_q: int):
    """(fp32 logits, each work's rows in them) of one step: replayed from graphs (a DecodeGraphs, or None) when every
    sequence feeds one token, or at most max_s_q (speculation: the graph pads each to max_s_q), else one eager
    forward."""
    use_paged = paged_ok(model, cache)
    if graphs is not None and use_paged and graphs.fits(len(works)):
        longest = max(len(w.tokens) for w in works)
        s_q = 1 if longest == 1 else max_s_q if longest <= max_s_q <= MAX_S_Q else 0
        if s_q:
            got = graphs.run(works, cache.allocator, s_q)
            if got is not None:
                return got
    batch = StepBatch(works, cache.allocator, model.device, paged_ok=use_paged)
    return model.forward(batch, cache), batch.logits_slices
