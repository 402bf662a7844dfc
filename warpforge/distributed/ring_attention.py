"""Context-parallel ring attention: exact attention over one long sequence sharded along its length across
the ranks of a torch.distributed process group (gloo on CPU, NCCL on GPUs).

Every rank holds the queries, keys and values of its own shard. K/V travel around the ring: at step i of W,
rank r holds the K/V that started on rank (r - i) mod W, attends its queries to them (the block), and folds
the partial result into a running fp32 (out, lse) pair. The next step's K/V are already on their way while a
block is computed. The backward walks the same ring with the final out and lse; the gradients of each K/V
block travel with it and arrive home after W steps.
Precision: each block's out, dq, dk and dv come from the kernels in the inputs' dtype (bf16 rounded, as one
flash_attention call's are) and are summed over the W blocks in fp32; the error of bf16 inputs therefore grows
slowly with W (W roundings of partial results rather than one).

Layouts (how the sequence is cut; `shard_sequence` / `unshard_sequence` convert):
- "zigzag": 2W chunks of s_local/2 tokens; rank r holds chunks r and 2W-1-r, in that order. Under a causal
  mask every rank then has the same amount of work (an early chunk and a late one).
- "contiguous": W chunks of s_local tokens; rank r holds chunk r. Causal work grows with the rank.

Which queries see which keys of a visiting block (causal; s is the rank the K/V started on):
- zigzag, s == r: both local chunks, in global order, against themselves: plain causal attention.
- zigzag, s < r: chunk s precedes both local chunks and chunk 2W-1-s follows both, so every local query sees
  the first half of the block (chunk s) in full and nothing of its second half.
- zigzag, s > r: both visiting chunks (s and 2W-1-s) fall between the local chunk r and the local chunk
  2W-1-r, so the second half of the local queries sees the whole block and the first half sees nothing.
- contiguous: s < r the whole block, s == r causal, s > r nothing.
Without a mask every query sees every block in full.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence, Union

import torch
import torch.distributed as dist

from ..errors import check_bool, check_choice, check_int, check_positive_float, check_tensor, fail
from ..ops.attention import api
from ..ops.attention.reference import visible_mask
from ..runtime import resolve_backend
from .group import resolve_group

LAYOUTS = ("zigzag", "contiguous")

# gloo matches point-to-point messages by (peer, tag): K/V and their gradient accumulators can be in flight
# between the same two ranks at once, so each gets its own tag (NCCL ignores tags and matches by order,
# which is the same on every rank)
_TAG_KV = 0
_TAG_DKV = 1


# ------------------------------------------------------------------------------------------ layouts
def _chunks_of(rank: int, world: int, layout: str) -> tuple[int, ...]:
    """The chunk indices rank holds, in local order (chunks of the full sequence cut into 2W for zigzag, W for
    contiguous)."""
    return (rank, 2 * world - 1 - rank) if layout == "zigzag" else (rank,)


def shard_sequence(x: torch.Tensor, rank: int, world: int, layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s shard of x (the full sequence along `dim`) under `layout`, for a group of `world` ranks.

    zigzag: x's length along dim divides into 2·world chunks; the shard is chunks rank and 2·world-1-rank
    concatenated (a new tensor). contiguous: the length divides into world chunks; the shard is chunk rank (a
    view of x)."""
    check_tensor("x", x)
    check_int("world", world, lo=1)
    check_int("rank", rank, lo=0, hi=world - 1)
    check_choice("layout", layout, LAYOUTS)
    if x.dim() == 0:
        fail("x", "a tensor with at least one dim", "a 0-d tensor")
    check_int("dim", dim, lo=-x.dim(), hi=x.dim() - 1)
    n_chunks = 2 * world if layout == "zigzag" else world
    length = x.size(dim)
    if length % n_chunks:
        fail("x", f"a length along dim {dim} divisible by {n_chunks} ({layout} over {world} ranks)", length)
    size = length // n_chunks
    parts = [x.narrow(dim, c * size, size) for c in _chunks_of(rank, world, layout)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def unshard_sequence(shards: Sequence[torch.Tensor], layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's shard (shards[r] is rank r's), the inverse of shard_sequence."""
    if not isinstance(shards, (list, tuple)) or not shards:
        fail("shards", "a non-empty list of tensors, one per rank", type(shards).__name__)
    for i, t in enumerate(shards):
        check_tensor(f"shards[{i}]", t)
        if t.shape != shards[0].shape:
            fail(f"shards[{i}]", f"shape {tuple(shards[0].shape)} (like shards[0])", tuple(t.shape))
    check_choice("layout", layout, LAYOUTS)
    world = len(shards)
    if layout == "contiguous":
        return torch.cat(list(shards), dim)
    if shards[0].size(dim) % 2:
        fail("shards", f"an even length along dim {dim} (zigzag: two chunks per rank)", shards[0].size(dim))
    half = shards[0].size(dim) // 2
    chunks = [None] * (2 * world)
    for r, t in enumerate(shards):
        for j, c in enumerate(_chunks_of(r, world, layout)):
            chunks[c] = t.narrow(dim, j * half, half)
    return torch.cat(chunks, dim)


# ----------------------------------------------------------------------------------------- the plan
class _Block(NamedTuple):
    """What one ring step computes: local query rows `q` attend rows `kv` of the visiting K/V, causally (the
    two sides have the same length and the same global order then) or without a mask."""
    q: slice
    kv: slice
    causal: bool


def _plan(layout: str, causal: bool, rank: int, src: int, s_local: int) -> Optional[_Block]:
    """The block of rank `rank` against the K/V that started on rank `src`, or None when no query sees them."""
    every = slice(0, s_local)
    if not causal:
        return _Block(every, every, False)
    if src == rank:
        return _Block(every, every, True)
    if layout == "contiguous":
        return _Block(every, every, False) if src < rank else None
    half = s_local // 2
    if src < rank:
        return _Block(every, slice(0, half), False)
    return _Block(slice(half, s_local), every, False)


class _Ring(NamedTuple):
    """The fixed facts of one call: the group, this rank's place in it (peers as global ranks, which P2POp
    takes), and the attention's settings."""
    group: object
    rank: int
    world: int
    send_to: int
    recv_from: int
    layout: str
    causal: bool
    scale: float
    backend: str


def _exchange(ring: _Ring, send: torch.Tensor, tag: int):
    """Start sending `send` to the next rank and receiving its twin from the previous one; (buffer, works)."""
    recv = torch.empty_like(send)
    ops = [dist.P2POp(dist.isend, send, ring.send_to, ring.group, tag),
           dist.P2POp(dist.irecv, recv, ring.recv_from, ring.group, tag)]
    return recv, dist.batch_isend_irecv(ops)


def _wait(works) -> None:
    for w in works:
        w.wait()


def _pack(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a and b in one flat buffer: one message per ring step instead of two."""
    return torch.cat([a.reshape(-1), b.reshape(-1)])


def _unpack(buf: torch.Tensor, a_shape, b_shape) -> tuple[torch.Tensor, torch.Tensor]:
    n = math.prod(a_shape)
    return buf[:n].view(a_shape), buf[n:].view(b_shape)


# --------------------------------------------------------------------------------- block primitives
def _reference_scores(q, k, scale, causal):
    """fp32 scores [b, h_q, s_q, s_k] (masked to -inf), and k repeated to q's heads."""
    group = q.shape[2] // k.shape[2]
    kf = k.float().repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), kf) * scale
    if causal:
        mask = visible_mask(q.shape[1], k.shape[1], (-1, 0), device=q.device)
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores


def _probs(scores: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """exp(scores - lse), 0 on rows whose lse is -inf (no key seen) instead of NaN."""
    return torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])


def _reference_block_fwd(q, k, v, scale, causal):
    """(out fp32 [b, s_q, h_q, d_v], lse fp32 [b, h_q, s_q]) of one block, in plain torch."""
    group = q.shape[2] // k.shape[2]
    scores = _reference_scores(q, k, scale, causal)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", _probs(scores, lse), v.float().repeat_interleave(group, dim=2))
    return out, lse


def _sum_group(x: torch.Tensor, h_kv: int) -> torch.Tensor:
    """[b, s, h_q, d] gradients of repeated K/V heads summed back to [b, s, h_kv, d] (query head i read kv head
    i // group)."""
    b, s, h_q, d = x.shape
    return x.view(b, s, h_kv, h_q // h_kv, d).sum(3)


def _reference_block_bwd(do, q, k, v, out, lse, scale, causal):
    """(dq, dk, dv) fp32 of one block given the final out and lse of its query rows, in plain torch: P =
    exp(S - lse), dV = Pᵀ dO, dP = dO Vᵀ, dS = P ⊙ (dP - delta) with delta = rowsum(out ⊙ dO), dQ = dS K·scale,
    dK = dSᵀ Q·scale."""
    h_kv = k.shape[2]
    group = q.shape[2] // h_kv
    dof = do.float()
    probs = _probs(_reference_scores(q, k, scale, causal), lse)
    delta = (out.float() * dof).sum(-1).transpose(1, 2)  # [b, h_q, s_q]
    dv = _sum_group(torch.einsum("bhqk,bqhd->bkhd", probs, dof), h_kv)
    dp = torch.einsum("bqhd,bkhd->bhqk", dof, v.float().repeat_interleave(group, dim=2))
    ds = probs * (dp - delta[..., None])
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, k.float().repeat_interleave(group, dim=2)) * scale
    dk = _sum_group(torch.einsum("bhqk,bqhd->bkhd", ds, q.float()), h_kv) * scale
    return dq, dk, dv


def _triton_band(causal: bool) -> tuple[int, int]:
    return api.band(causal, (-1, -1))[1]


def _triton_block_fwd(q, k, v, scale, causal):
    """(out in q's dtype, lse fp32) of one block, by the attention family's forward kernel."""
    q, k, v = (t.contiguous() for t in (q, k, v))  # row slices of the shard: give the kernels dense tensors
    left, right = _triton_band(causal)
    return api._flash_fwd_impl(q, k, v, None, None, q.shape[0], q.shape[1], k.shape[1], scale, left, right, 0.0,
                               None, False)


def _triton_block_bwd(do, q, k, v, out, lse, scale, causal):
    """(dq, dk, dv) of one block, by the attention family's backward kernels (which compute delta from the
    out and do they are given: the final ones, so it is the global delta)."""
    do, q, k, v, out, lse = (t.contiguous() for t in (do, q, k, v, out, lse))
    left, right = _triton_band(causal)
    return api._flash_bwd_impl(do, q, k, v, out, lse, None, None, q.shape[0], q.shape[1], k.shape[1], scale,
                               left, right, 0.0, None, False)


_BLOCK_FWD = {"reference": _reference_block_fwd, "triton": _triton_block_fwd}
_BLOCK_BWD = {"reference": _reference_block_bwd, "triton": _triton_block_bwd}


def _merge(acc_out: torch.Tensor, acc_lse: torch.Tensor, rows: slice, out: torch.Tensor, lse: torch.Tensor):
    """Fold a block's (out, lse) for query rows `rows` into the fp32 accumulators, in place:
    out = Σ out_i · exp(lse_i - lse), lse = logsumexp(lse_i). Rows that have seen no key yet (lse -inf on
    both sides) stay 0 and -inf."""
    old_lse = acc_lse[:, :, rows]
    new_lse = torch.logaddexp(old_lse, lse)
    base = new_lse.masked_fill(torch.isinf(new_lse), 0.0)  # -inf - -inf would be NaN; exp(-inf - 0) is 0
    w_old = torch.exp(old_lse - base).transpose(1, 2)[..., None]  # [b, s, h, 1]
    w_new = torch.exp(lse - base).transpose(1, 2)[..., None]
    acc_out[:, rows] = acc_out[:, rows] * w_old + out.float() * w_new
    acc_lse[:, :, rows] = new_lse


# ------------------------------------------------------------------------------------ the ring passes
def _ring_fwd(ring: _Ring, q, k, v):
    """(out in q's dtype [b, s, h_q, d_v], lse fp32 [b, h_q, s]) of this rank's queries against the whole
    sequence."""
    b, s, h_q, _ = q.shape
    acc_out = torch.zeros(b, s, h_q, v.shape[-1], dtype=torch.float32, device=q.device)
    acc_lse = torch.full((b, h_q, s), float("-inf"), dtype=torch.float32, device=q.device)
    if q.numel() == 0 or k.numel() == 0:  # nothing to attend or nothing attends: no messages (all ranks agree)
        return acc_out.to(q.dtype), acc_lse
    block_fwd = _BLOCK_FWD[ring.backend]
    kv = _pack(k, v)
    for step in range(ring.world):
        # the next step's K/V are requested before this block is computed so the transfer hides behind it
        ahead = _exchange(ring, kv, _TAG_KV) if step + 1 < ring.world else None
        blk = _plan(ring.layout, ring.causal, ring.rank, (ring.rank - step) % ring.world, s)
        if blk is not None:
            k_i, v_i = _unpack(kv, k.shape, v.shape)
            out_i, lse_i = block_fwd(q[:, blk.q], k_i[:, blk.kv], v_i[:, blk.kv], ring.scale, blk.causal)
            _merge(acc_out, acc_lse, blk.q, out_i, lse_i)
        if ahead is not None:
            _wait(ahead[1])
            kv = ahead[0]
    return acc_out.to(q.dtype), acc_lse


def _ring_bwd(ring: _Ring, do, q, k, v, out, lse):
    """(dq, dk, dv) of this rank's shard. dq sums locally; the fp32 dk/dv of each K/V block ride the ring
    behind it, each rank adding its part, and are back on the block's home rank after W steps."""
    s = q.shape[1]
    block_bwd = _BLOCK_BWD[ring.backend]
    if q.numel() == 0 or k.numel() == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = _pack(k, v)
    incoming = None  # (buffer, works): the dk/dv accumulator of the block that arrives next
    for step in range(ring.world):
        ahead = _exchange(ring, kv, _TAG_KV) if step + 1 < ring.world else None
        blk = _plan(ring.layout, ring.causal, ring.rank, (ring.rank - step) % ring.world, s)
        grads = None
        if blk is not None:
            k_i, v_i = _unpack(kv, k.shape, v.shape)
            rows = blk.q
            dq_i, dk_i, dv_i = block_bwd(do[:, rows], q[:, rows], k_i[:, blk.kv], v_i[:, blk.kv], out[:, rows],
                                         lse[:, :, rows], ring.scale, blk.causal)
            dq[:, rows] += dq_i.float()
            grads = (dk_i, dv_i)
        # the accumulator for this block was sent by the previous rank after its step; wait for it only now,
        # after this step's compute
        if incoming is None:
            dkv = torch.zeros(k.numel() + v.numel(), dtype=torch.float32, device=q.device)
        else:
            _wait(incoming[1])
            dkv = incoming[0]
        if grads is not None:
            dk_acc, dv_acc = _unpack(dkv, k.shape, v.shape)
            dk_acc[:, blk.kv] += grads[0].float()
            dv_acc[:, blk.kv] += grads[1].float()
        if ring.world > 1:
            incoming = _exchange(ring, dkv, _TAG_DKV)
        if ahead is not None:
            _wait(ahead[1])
            kv = ahead[0]
    if incoming is not None:  # the last send brings every accumulator home
        _wait(incoming[1])
        dkv = incoming[0]
    dk, dv = _unpack(dkv, k.shape, v.shape)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    """out, lse = ring attention of this rank's shard; backward returns the shard's dq, dk, dv."""

    @staticmethod
    def forward(ctx, q, k, v, ring):
        out, lse = _ring_fwd(ring, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_bwd(ctx.ring, d_out, q, k, v, out, lse)
        return dq, dk, dv, None


# ----------------------------------------------------------------------------------- the public door
def _validate(q, k, v, causal, softmax_scale, layout, return_lse, backend):
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t)
    api.check_qkv(q, k, v, 4, backend)  # flash_attention's own checks of the tensors
    if k.shape[:2] != q.shape[:2]:
        fail("k", f"batch and shard length {tuple(q.shape[:2])} (like q: every rank holds the same s_local of q, "
             "k and v)", tuple(k.shape[:2]))
    check_bool("causal", causal)
    check_bool("return_lse", return_lse)
    check_positive_float("softmax_scale", softmax_scale)
    check_choice("layout", layout, LAYOUTS)
    if layout == "zigzag" and q.shape[1] % 2:
        fail("q", "an even shard length (zigzag: two chunks of s_local/2 per rank)", q.shape[1])


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                   softmax_scale: Optional[float] = None, layout: str = "zigzag", group=None,
                   return_lse: bool = False,
                   backend: Optional[str] = None) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """This rank's shard of flash_attention(q_full, k_full, v_full, causal=causal) over a sequence sharded
    along its length across the ranks of `group` (default: the world), with autograd.

    q [b, s_local, h_q, d], k [b, s_local, h_kv, d], v [b, s_local, h_kv, d_v]: this rank's shard in `layout`
    ("zigzag" or "contiguous", see the module docstring and shard_sequence); every rank of the group holds the
    same shapes (not checked across ranks: that would cost a collective per call) and calls this together.
    h_q % h_kv == 0 (GQA); d and d_v multiples of 8 up to 256; fp16, bf16 or fp32. causal masks by global
    position. backend: "triton" (the attention kernels; on CPU the Triton interpreter) or "reference"
    (plain torch), default by q's device (runtime.resolve_backend).

    Returns out [b, s_local, h_q, d_v] in q's dtype, and lse fp32 [b, h_q, s_local] if return_lse (not
    differentiable). Partial results are combined in fp32; the backward keeps dq and the travelling dk/dv in
    fp32. A group of one rank is plain attention; without an initialized process group this raises.
    """
    if isinstance(q, torch.Tensor):
        backend = resolve_backend(backend, q.device)
    _validate(q, k, v, causal, softmax_scale, layout, return_lse, backend)
    g = resolve_group(group, "ring attention runs over its ranks")
    group, rank, world = g
    send_to, recv_from = g.global_rank((rank + 1) % world), g.global_rank((rank - 1) % world)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    ring = _Ring(group, rank, world, send_to, recv_from, layout, causal, scale, backend)
    out, lse = _RingAttention.apply(q, k, v, ring)
    return (out, lse) if return_lse else out
