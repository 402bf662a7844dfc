"""One engine step's input as the forward reads it: the new tokens of every scheduled sequence packed into one
row, their positions and cache slots, and how their attention is grouped.

Sequences whose new tokens number at most paged.MAX_S_Q (16; decode: 1; speculative verification: k + 1 for up to
15 drafts; a short prompt) attend through `paged_decode`, one call per distinct count (its s_q). Longer runs of new tokens (prefill
and its chunks) attend through `flash_attention` in its packed varlen form: against their own new K/V when none
of them has earlier tokens in the cache, else against K/V gathered from their pages. A head dim the paged op does
not take (paged.head_dims: multiples of 8 up to 256, of the FP4 block for FP4 caches) sends every sequence
the varlen way.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from ..ops import paged


def cache_slots(table: list, positions, page: int) -> list:
    """Flat cache slots (page id x page size + offset) of a sequence's positions, through its block table."""
    return [table[t // page] * page + t % page for t in positions]


@dataclass
class SeqWork:
    """What a step does for one sequence: feed `tokens` at positions start.. (start: the tokens already in its
    cache) and return logits for none of them, the last, or all (speculative verification)."""
    seq_id: object
    tokens: list
    start: int
    logits: str = "last"    # "none" | "last" | "all"


@dataclass
class DecodeGroup:
    s_q: int
    rows: list                          # indices into the step's works
    token_index: Optional[torch.Tensor]  # the group's tokens in the packed row (None: all of them, in order)
    block_table: torch.Tensor            # int32 [b, pages]
    seqlens: torch.Tensor                # int32 [b]: tokens in the cache, the new ones included
    plans: dict = field(default_factory=dict)  # (window, scale) -> PagedPlan, made at the first layer


@dataclass
class VarlenGroup:
    rows: list
    token_index: Optional[torch.Tensor]
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    context_slots: Optional[torch.Tensor]  # flat slots of every sequence's whole context; None: new tokens only


class StepBatch:
    def __init__(self, works: list, allocator, device, *, paged_ok: bool = True):
        self.works = works
        page = allocator.page_size
        ids, pos, slots, logit_rows = [], [], [], []
        self.logits_slices = []  # per work: its rows in the step's logits
        offsets = []
        for w in works:
            table = allocator.tables[w.seq_id]
            n = len(w.tokens)
            offsets.append(len(ids))
            ids.extend(w.tokens)
            p = range(w.start, w.start + n)
            pos.extend(p)
            slots.extend(cache_slots(table, p, page))
            first = len(logit_rows)
            if w.logits == "all":
                logit_rows.extend(range(offsets[-1], offsets[-1] + n))
            elif w.logits == "last":
                logit_rows.append(offsets[-1] + n - 1)
            self.logits_slices.append(slice(first, len(logit_rows)))
        self.num_tokens = len(ids)
        self.input_ids = torch.tensor(ids, dtype=torch.long, device=device)
        self.positions = torch.tensor(pos, dtype=torch.long, device=device)
        self.slots = torch.tensor(slots, dtype=torch.long, device=device)
        self.logits_index = torch.tensor(logit_rows, dtype=torch.long, device=device)
        self.all_logits = len(logit_rows) == len(ids)

        by_len: dict = {}
        varlen = []
        for i, w in enumerate(works):
            if paged_ok and len(w.tokens) <= paged.MAX_S_Q:
                by_len.setdefault(len(w.tokens), []).append(i)
            else:
                varlen.append(i)
        self.decode_groups = []
        for s_q, rows in sorted(by_len.items()):
            tables = [allocator.tables[works[i].seq_id] for i in rows]
            width = max(len(t) for t in tables)
            bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
            lens = torch.tensor([works[i].start + s_q for i in rows], dtype=torch.int32, device=device)
            self.decode_groups.append(DecodeGroup(s_q, rows, self._index(rows, offsets, device), bt, lens))
        self.varlen = None
        if varlen:
            q_lens = [len(works[i].tokens) for i in varlen]
            k_lens = [works[i].start + n for i, n in zip(varlen, q_lens)]
            fresh = all(works[i].start == 0 for i in varlen)
            ctx = None
            if not fresh:
                ctx = []
                for i, n in zip(varlen, k_lens):
                    table = allocator.tables[works[i].seq_id]
                    ctx.extend(cache_slots(table, range(n), page))
                ctx = torch.tensor(ctx, dtype=torch.long, device=device)
            cu_q = torch.tensor([0] + _cumsum(q_lens), dtype=torch.int32, device=device)
            cu_k = cu_q if fresh else torch.tensor([0] + _cumsum(k_lens), dtype=torch.int32, device=device)
            self.varlen = VarlenGroup(varlen, self._index(varlen, offsets, device), cu_q, cu_k, max(q_lens),
                                      max(k_lens), ctx)

    def _index(self, rows, offsets, device) -> Optional[torch.Tensor]:
        idx = [offsets[i] + j for i in rows for j in range(len(self.works[i].tokens))]
        if idx == list(range(self.num_tokens)):
            return None
        return torch.tensor(idx, dtype=torch.long, device=device)


def _cumsum(xs):
    out, total = [], 0
    for x in xs:
        total += x
        out.append(total)
    return out
