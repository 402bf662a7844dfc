"""A draft model's k greedy steps as one CUDA-graph replay (per batch-size bucket).

Why: at batch 1 a small target's decode step is bound by its launches and the host, not by its bytes (a gpt2-124m
shape: ~0.8 ms a token on the H200, plain decode replayed from a graph). A draft model run step by step pays that
cost k times a round, each step a replay and a read back, so it cannot make decoding faster however often its drafts
are accepted. Here the round's steps are captured together: step 0 feeds each sequence's new tokens (the ones it has
not seen, padded to k + 1 as DecodeGraphs pads them) and takes the argmax at its last real row; steps 1 .. k - 1 feed
the previous step's argmax, which never leaves the device. One replay and one read back give every sequence's k
drafts.

Only greedy requests that all draft the same k take it (the per-step loop of DraftModelDrafter takes the rest: a
sampled draft needs its request's generator and keeps its distributions). Positions, cache slots and lengths of
every step are known before the round (step j writes position start + n + j - 1) and are filled into each step's
static buffers; all steps read the first step's block table. On a device without CUDA graphs (`capture=False`, the
CPU tests) the same steps run eagerly.
"""
from __future__ import annotations

import torch

from ..ops.paged import MAX_S_Q
from . import cuda_graphs
from .batch import cache_slots
from .cuda_graphs import DecodeGraphs


class DraftChain:
    def __init__(self, model, cache, graphs: DecodeGraphs, k: int, vocab: int, capture: bool = True):
        self.model, self.cache, self.graphs = model, cache, graphs
        self.k, self.vocab, self.capture = k, vocab, capture
        self.chains: dict = {}
        # step 0 attends through paged_decode at s_q = k + 1 (the step-by-step loop takes k >= 16 the varlen way)
        self.usable = k + 1 <= MAX_S_Q and cuda_graphs.paged_ok(model, cache)

    def _buffers(self, b: int) -> dict:
        g = self.graphs
        first = g.static_batch(b, self.k + 1)
        steps = [g.static_batch(b, 1) for _ in range(self.k - 1)]
        for st in steps:  # every step reads the first's block table: filled once a round
            st.decode_groups[0].block_table = first.decode_groups[0].block_table
        return {"first": first, "steps": steps, "last_row": torch.arange(b, device=self.model.device) * (self.k + 1)}

    def _steps(self, ch: dict) -> torch.Tensor:
        """The round on the static buffers: [b, k] draft ids (argmax over the target's vocabulary)."""
        logits = self.model.forward(ch["first"], self.cache)
        tok = logits[ch["last_row"], :self.vocab].argmax(-1)
        toks = [tok]
        for st in ch["steps"]:
            st.input_ids.copy_(tok)
            tok = self.model.forward(st, self.cache)[:, :self.vocab].argmax(-1)
            toks.append(tok)
        return torch.stack(toks, 1)

    def _chain(self, b: int) -> dict:
        ch = self._buffers(b)
        if self.capture:
            ch["graph"], ch["out"] = self.graphs.capture(lambda: self._steps(ch))
        return ch

    def _fill(self, ch: dict, works: list, alloc) -> bool:
        if not self.graphs.fill(ch["first"], works, alloc):
            return False
        page = self.graphs.page_size
        b = ch["first"].decode_groups[0].block_table.shape[0]
        rows = [i * (self.k + 1) + len(w.tokens) - 1 for i, w in enumerate(works)]
        ch["last_row"].copy_(torch.tensor(rows + [0] * (b - len(works))), non_blocking=True)
        for j, st in enumerate(ch["steps"], start=1):
            pos, slots, lens = [], [], []
            for w in works:
                p = w.start + len(w.tokens) + j - 1
                t = alloc.tables[w.seq_id]
                if p // page >= len(t):
                    return False
                pos.append(p)
                slots += cache_slots(t, (p,), page)
                lens.append(p + 1)
            pad = b - len(works)
            st.positions.copy_(torch.tensor(pos + [0] * pad), non_blocking=True)
            st.slots.copy_(torch.tensor(slots + [-1] * pad), non_blocking=True)
            st.decode_groups[0].seqlens.copy_(torch.tensor(lens + [1] * pad, dtype=torch.int32), non_blocking=True)
        return True

    def run(self, works: list, alloc):
        """The k drafts of each work (a SeqWork feeding a sequence's unseen tokens, at most k + 1, whose pages hold
        k - 1 more), or None when the graphs do not fit the step (the caller drafts step by step)."""
        if (not self.usable or not self.graphs.fits(len(works)) or any(len(w.tokens) > self.k + 1 for w in works)
                or not self.graphs.holds(works, alloc, self.k + 1)):
            return None
        b = self.graphs.bucket(len(works))
        ch = self.chains.get(b)
        if ch is None:
            ch = self.chains[b] = self._chain(b)
        if not self._fill(ch, works, alloc):
            return None
        if self.capture:
            ch["graph"].replay()
            out = ch["out"]
        else:
            out = self._steps(ch)
        return out[:len(works)].tolist()
