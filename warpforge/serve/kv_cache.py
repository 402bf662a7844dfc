"""The paged KV cache: page storage per layer in the paged op's layout ([num_pages, page_size, h_kv, width] per
layer, for K and for V) and the block allocator that hands pages to sequences.

The allocator is host-side bookkeeping only: a free list of page ids, and per sequence its block table (the pages
holding its tokens, in order) and its token count. Sequences grow a page at a time (`reserve`), give back the
pages of tokens that were rolled back (`truncate`: rejected speculative tokens) and give back everything when
they finish or are aborted (`release`). Pages hold no sequence id, so a leak is a page neither free nor in a
table: `check_no_leaks` says whether every page is accounted for.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..errors import WarpforgeInputError, check_choice, check_int, fail
from ..ops import paged
from ..ops.attention.api import MAX_HEAD_DIM


class OutOfPages(RuntimeError):
    """Not enough free pages for a reservation (the engine preempts or waits; nothing was taken)."""


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int):
        check_int("num_pages", num_pages, lo=1)
        self.num_pages, self.page_size = num_pages, page_size
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: the lowest ids first (pops from the end)
        self.tables: dict = {}    # sequence id -> [page ids]
        self.lengths: dict = {}   # sequence id -> tokens the sequence's pages hold (reserved room may be more)

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def pages_in_use(self) -> int:
        return self.num_pages - len(self._free)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def can_reserve(self, seq_id, tokens: int) -> bool:
        have = len(self.tables.get(seq_id, ()))
        return self.pages_for(tokens) - have <= len(self._free)

    def reserve(self, seq_id, tokens: int) -> list:
        """Grows seq_id's block table to hold `tokens` tokens (a new sequence starts empty); returns the table.
        OutOfPages (taking nothing) if the free list is too short."""
        table = self.tables.setdefault(seq_id, [])
        self.lengths.setdefault(seq_id, 0)
        need = self.pages_for(tokens) - len(table)
        if need > len(self._free):
            if not table:
                del self.tables[seq_id], self.lengths[seq_id]
            raise OutOfPages(f"{need} pages wanted, {len(self._free)} free")
        for _ in range(max(need, 0)):
            table.append(self._free.pop())
        return table

    def set_length(self, seq_id, tokens: int) -> None:
        """Records that seq_id's pages now hold `tokens` tokens (they must have been reserved)."""
        if self.pages_for(tokens) > len(self.tables[seq_id]):
            raise RuntimeError(f"sequence {seq_id!r}: {tokens} tokens exceed its reserved pages")
        self.lengths[seq_id] = tokens

    def truncate(self, seq_id, tokens: int) -> None:
        """Keeps the first `tokens` tokens of seq_id and frees the pages past them (a rollback)."""
        table = self.tables[seq_id]
        keep = self.pages_for(tokens)
        while len(table) > keep:
            self._free.append(table.pop())
        self.lengths[seq_id] = min(self.lengths[seq_id], tokens)

    def release(self, seq_id) -> None:
        """Frees every page of seq_id (finished, aborted or preempted); a sequence without pages is a no-op."""
        for page in reversed(self.tables.pop(seq_id, [])):
            self._free.append(page)
        self.lengths.pop(seq_id, None)

    def check_no_leaks(self) -> bool:
        """Every page is free or in exactly one table."""
        held = [p for t in self.tables.values() for p in t]
        return sorted(held + self._free) == list(range(self.num_pages))


# How an FP4 cache is laid out (paged/kv_format.py): "rows" (each token row its packed values, then its block
# scales) or "pair" (values and block scales in tensors of their own, FlashInfer's layout). The pair's 64-byte value
# rows take 16-byte copies and ran 19-23% faster on an H100 (benchmarks/NOTES.md, session 42); it becomes the default
# once the Gluon kernel reads an NVFP4 pair right under CUDA-graph replay (paged/api.nvfp4_pair_held_back).
FP4_LAYOUTS = ("rows", "pair")
FP4_LAYOUT = "rows"


class PairLayers:
    """An FP4 cache in the pair layout, every layer in two allocations: [layer] is the pair (values [num_pages,
    page_size, h_kv, d/2], block scales [num_pages, page_size, h_kv, d/block]) that the paged ops take."""

    def __init__(self, values: torch.Tensor, scales: torch.Tensor):
        self.values, self.scales = values, scales

    def __getitem__(self, layer: int):
        return self.values[layer], self.scales[layer]

    def __len__(self) -> int:
        return self.values.shape[0]


class PagedKVCache:
    """K and V pages for every layer, one allocation each: k[layer] is [num_pages, page_size, h_kv, width] in
    kv_format, the layout paged_decode reads (an FP4 cache in the pair layout: k[layer] is the pair, see PairLayers).
    Quantised formats keep one fixed per-tensor scale per layer (fp8: 1.0, as vLLM's default; nvfp4: a tensor scale
    sized for |values| up to `amax`), since pages are filled a token at a time and a scale computed from later
    tokens could not re-scale the earlier ones. fp4_layout: "rows" or "pair" for the FP4 formats (None: FP4_LAYOUT)."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 kv_format: str, dtype: torch.dtype, device, amax: float = 64.0, fp4_layout: Optional[str] = None):
        check_choice("kv_format", kv_format, tuple(paged.KV_FORMATS))
        check_choice("page_size", page_size, paged.PAGE_SIZES)
        fp4_layout = FP4_LAYOUT if fp4_layout is None else fp4_layout
        check_choice("fp4_layout", fp4_layout, FP4_LAYOUTS)
        fmt = paged.KV_FORMATS[kv_format]
        if head_dim % 8 or not 8 <= head_dim <= MAX_HEAD_DIM:  # neither paged_decode nor flash_attention takes it
            fail("head_dim", f"a multiple of 8 from 8 to {MAX_HEAD_DIM} (the attention ops' head dims)", head_dim)
        if fmt.quantized and head_dim not in paged.head_dims(kv_format):
            fail("kv_format", f"a values format (bf16/fp16/fp32) at head dim {head_dim} ({kv_format} takes head "
                 f"dims {paged.head_dims(kv_format)})", repr(kv_format))
        self.kv_format, self.fmt, self.page_size = kv_format, fmt, page_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        # the dtype attention runs in over this cache: a values format's own, or the model's for quantised ones
        self.attn_dtype = fmt.storage if not fmt.quantized else dtype
        self.pair = fmt.fp4 and fp4_layout == "pair"
        lead = (num_layers, num_pages, page_size, num_kv_heads)
        if self.pair:
            self.k, self.v = (PairLayers(torch.zeros(*lead, head_dim // 2, dtype=fmt.storage, device=device),
                                         torch.zeros(*lead, fmt.scale_width(head_dim), dtype=fmt.storage,
                                                     device=device)) for _ in range(2))
        else:
            self.k, self.v = (torch.zeros(*lead, fmt.width(head_dim), dtype=fmt.storage, device=device)
                              for _ in range(2))
        self.allocator = PageAllocator(num_pages, page_size)
        if kv_format == "fp8":
            self.k_scale = self.v_scale = torch.ones(1, dtype=torch.float32, device=device)
        elif kv_format == "nvfp4":
            self.k_scale = self.v_scale = torch.full((1,), amax / (6.0 * 448.0), dtype=torch.float32, device=device)
        else:
            self.k_scale = self.v_scale = None

    @staticmethod
    def bytes_per_page(num_layers, page_size, num_kv_heads, head_dim, kv_format) -> int:
        fmt = paged.KV_FORMATS[kv_format]
        elem = torch.empty((), dtype=fmt.storage).element_size()
        return 2 * num_layers * page_size * num_kv_heads * fmt.width(head_dim) * elem

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Stores new tokens k / v [T, h_kv, d] at flat slots [T] (page · page_size + offset; -1 skips a token) of
        this layer: one paged.append_kv_slots call for K and V, which quantises for the quantised formats."""
        if not self.fmt.quantized:  # a values cache holds its own dtype (the model's may differ)
            k, v = k.to(self.fmt.storage), v.to(self.fmt.storage)
        paged.append_kv_slots(self.k[layer], self.v[layer], k, v, slots, kv_format=self.kv_format,
                              k_scale=self.k_scale, v_scale=self.v_scale)

    def gather(self, layer: int, slots: torch.Tensor, dtype: Optional[torch.dtype] = None):
        """K and V of the tokens at flat slots [n] of this layer, [n, h_kv, d] in dtype (dequantised)."""
        out = []
        for cache, scale in ((self.k[layer], self.k_scale), (self.v[layer], self.v_scale)):
            rows = tuple(part.flatten(0, 1)[slots][:, None] for part in (cache if self.pair else (cache,)))
            if self.fmt.quantized:
                rows = paged.dequantize_kv_reference(rows if self.pair else rows[0], self.kv_format, scale)
            else:
                rows = rows[0]
            out.append(rows[:, 0].to(dtype or self.attn_dtype))
        return out[0], out[1]


def check_kv_format(kv_format) -> None:
    if kv_format is not None and kv_format not in paged.KV_FORMATS:
        raise WarpforgeInputError(f"kv_format: expected None or one of {tuple(paged.KV_FORMATS)}, got {kv_format!r}")
