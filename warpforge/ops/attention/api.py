"""`flash_attention`: FlashAttention's interface on warpforge kernels. validate -> plan -> dispatch (the
reference, or the Triton kernels as ops with autograd)."""
from __future__ import annotations

import math
import os
from typing import Optional, Union

import torch

from ...errors import (SCALE_MAX, check_bool, check_cu_seqlens, check_dtype, check_int, check_last_dim_contiguous,
                       check_positive_float, check_rank, check_same_device, check_same_dtype, check_tensor,
                       dense_like, fail, host_reads_allowed, read_once)
from ...runtime import arch_key, check_interpreted_matmul_dtype, resolve_backend
from .._op import cached_launch, kernel_op
from . import configs
from .reference import attention_reference, attention_varlen_reference

MAX_HEAD_DIM = 256  # head dims (of q/k and of v) are multiples of 8 up to this
_UNBOUNDED = 1 << 30  # a window side of -1 becomes "further than any sequence"


def _cfgs(q: torch.Tensor, v: torch.Tensor, deterministic: bool = False):
    """The (forward, dk/dv, dq) tiles, keyed by the padded width of the wider head dim."""
    dp = max(16, 1 << (max(q.shape[-1], v.shape[-1]) - 1).bit_length())
    kind = ("fp32", dp) if q.dtype == torch.float32 else dp  # fp32 tiles: twice the bytes per element
    fwd, dkdv, dq = configs.TILES.lookup(q.device, kind)
    return fwd, dkdv._replace(atomic_dq=dkdv.atomic_dq and not deterministic), dq


# ------------------------------------------------------------------------------------------- ops
def _flash_fwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: Optional[torch.Tensor],
                    cu_k: Optional[torch.Tensor], batch: int, max_q: int, max_k: int, scale: float, left: int,
                    right: int, softcap: float, slopes: Optional[torch.Tensor],
                    deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse); deterministic is the backward's, carried here for autograd."""
    from . import flash_ws_kernel
    from .flash_kernel import ScoreMod, flash_fwd

    cfg, _, _ = _cfgs(q, v)
    plain = softcap == 0.0 and slopes is None and v.shape[-1] == q.shape[-1]
    if cu_q is None and plain and gluon_gate(q, k, v, left, right):  # Hopper, Gluon: FA3's schedule
        from . import flash_gluon_kernel
        return flash_gluon_kernel.flash_fwd_gluon(q, k, v, scale, right == 0, *gluon_knobs(q.shape[-1], right == 0),
                                                  left=_gluon_left(k, left), launch=cached_launch)
    if cfg.ws and cu_q is None and plain and flash_ws_kernel.fits(q, k, v):  # the Hopper pipeline's forward
        return flash_ws_kernel.flash_fwd_ws(q, k, v, batch, max_q, max_k, scale, left, right, cfg)
    return flash_fwd(q, k, v, cu_q, cu_k, batch, max_q, max_k, scale, left, right, cfg,
                     ScoreMod(scale, softcap, slopes))


def _flag(env: str, default: bool) -> bool:
    """env "0" off, any other value on, unset `default`. Read on the host (the ops are opaque to torch.compile)."""
    flag = os.environ.get(env)
    return default if flag is None else flag != "0"


def _switch(env: str, default: bool) -> bool:
    """A Gluon kernel's switch (_flag), and a Triton whose Gluon API the kernels were written for."""
    if not _flag(env, default):
        return False
    import triton
    return triton.__version__.startswith(configs.GLUON_TRITON_VERSIONS)


def _gluon_switch() -> bool:
    """WARPFORGE_ATTN_GLUON, default configs.GLUON_DEFAULT."""
    return _switch(configs.GLUON_ENV, configs.GLUON_DEFAULT)


def causal_or_open_right(s_q: int, right: int) -> bool:
    """Whether the band's right side is causal (0) or bounds nothing at this query length. Bands are bottom-right
    aligned: query c sees keys c + s_k - s_q - left .. c + s_k - s_q + right, so a right bound is unbounded from
    s_q - 1 on (the old test, right >= s_k, let a real bound through when s_q > s_k + 1)."""
    return right == 0 or right >= s_q - 1


def causal_or_unmasked(s_q: int, s_k: int, left: int, right: int) -> bool:
    """Whether the band (left, right) is no mask or causal at these lengths, the only masks the FP8 Gluon kernel
    takes: no left window (a left bound is unbounded from s_k - 1; taken from s_k on) and causal_or_open_right."""
    return left >= s_k and causal_or_open_right(s_q, right)


def _gluon_window_switch() -> bool:
    """WARPFORGE_ATTN_GLUON_WINDOW ("0": left windows go to the portable kernels), default
    configs.GLUON_WINDOW_DEFAULT."""
    return _flag(configs.GLUON_WINDOW_ENV, configs.GLUON_WINDOW_DEFAULT)


def _gluon_left(k, left: int):
    """The left window the Gluon kernels get: None when it bounds nothing (left >= s_k - 1: no query's window starts
    past key 0)."""
    return left if left < k.shape[1] - 1 else None


def _gluon_shape_ok(q, k, left, right) -> bool:
    """What both Gluon kernels take: a 4-d fp16/bf16 batch on an sm_90 device, head dim 64 or 128, no mask, causal,
    or a left window (sliding window; right 0 or unbounded; switch _gluon_window_switch). A right side that bounds
    something other than the causal diagonal goes to the portable kernels (causal_or_open_right)."""
    if q.device.type != "cuda" or q.dim() != 4 or arch_key(q.device) != "sm90":
        return False
    if not causal_or_open_right(q.shape[1], right):
        return False
    if _gluon_left(k, left) is not None and not _gluon_window_switch():
        return False
    return q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] in configs.GLUON_HEAD_DIMS


def gluon_knobs(d: int, causal: bool) -> tuple[int, int, bool, bool]:
    """(BLOCK_N, STAGES, PINGPONG, PERSISTENT) of the Gluon forward: configs.GLUON_FWD, each overridable for sweeps
    through WARPFORGE_ATTN_GLUON_BLOCK_N / _STAGES / _PINGPONG / _PERSISTENT (scripts/bench_attention_gluon.py)."""
    block_n, stages, pingpong, persistent = configs.GLUON_FWD[(d, bool(causal))]
    env = os.environ
    return (int(env.get("WARPFORGE_ATTN_GLUON_BLOCK_N", block_n)), int(env.get("WARPFORGE_ATTN_GLUON_STAGES", stages)),
            env.get("WARPFORGE_ATTN_GLUON_PINGPONG", "1" if pingpong else "0") != "0",
            env.get("WARPFORGE_ATTN_GLUON_PERSISTENT", "1" if persistent else "0") != "0")


def gluon_gate(q, k, v, left, right) -> bool:
    """Whether the batched forward takes the Hopper Gluon kernel (flash_gluon_kernel.py): an sm_90 device, a Triton
    in configs.GLUON_TRITON_VERSIONS, the switch on (_gluon_switch), fp16/bf16, head dim 64 or 128 for q, k and v,
    no mask or causal (no window), TMA-aligned tensors. The caller has already ruled out varlen, softcap, ALiBi
    and a separate V head dim; everything else runs the portable kernel."""
    if not (_gluon_shape_ok(q, k, left, right) and _gluon_switch()):
        return False
    from . import flash_gluon_kernel
    return flash_gluon_kernel.fits(q, k, v) and flash_gluon_kernel.available()


def _flash_fwd_fake(q, k, v, cu_q, cu_k, batch, max_q, max_k, scale, left, right, softcap, slopes, deterministic):
    if cu_q is not None:
        lse = q.new_empty((q.shape[-2], q.shape[0]), dtype=torch.float32)
    else:
        lse = q.new_empty((batch, q.shape[-2], max_q), dtype=torch.float32)
    return q.new_empty(*q.shape[:-1], v.shape[-1]), lse


def _flash_bwd_impl(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, cu_q: Optional[torch.Tensor], cu_k: Optional[torch.Tensor], batch: int,
                    max_q: int, max_k: int, scale: float, left: int, right: int, softcap: float,
                    slopes: Optional[torch.Tensor],
                    deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from .flash_kernel import ScoreMod, flash_bwd

    _, cfg_dkdv, cfg_dq = _cfgs(q, v, deterministic)
    if do.stride(-1) != 1:
        do = do.contiguous()
    plain = cu_q is None and softcap == 0.0 and slopes is None and v.shape[-1] == q.shape[-1]
    if plain and gluon_bwd_gate(q, k, v, out, do, left, right, deterministic):  # Hopper, Gluon: FA3's schedule
        from . import flash_gluon_bwd_kernel
        knobs = gluon_bwd_knobs(q.shape[-1], right == 0)
        split = gluon_bwd_group_split(q.shape[-1], q.shape[-2] // k.shape[-2], *knobs)
        order = flash_gluon_bwd_kernel.head_group(q.shape[0] * k.shape[-2] * split, int(os.environ.get(
            "WARPFORGE_ATTN_GLUON_BWD_HEAD_GROUP", configs.GLUON_BWD_HEAD_GROUP)))
        key_rows = gluon_bwd_key_rows(*knobs)
        return flash_gluon_bwd_kernel.flash_bwd_gluon(do, q, k, v, out, lse, scale, right == 0, *knobs,
                                                      group_split=split, left=_gluon_left(k, left),
                                                      launch=cached_launch, head_group=order, key_rows=key_rows)
    return flash_bwd(do, q, k, v, out, lse, cu_q, cu_k, batch, max_q, max_k, scale, left, right, cfg_dkdv,
                     cfg_dq, ScoreMod(scale, softcap, slopes))


def _gluon_bwd_switch() -> bool:
    """WARPFORGE_ATTN_GLUON_BWD, default configs.GLUON_BWD_DEFAULT."""
    return _switch(configs.GLUON_BWD_ENV, configs.GLUON_BWD_DEFAULT)


def gluon_bwd_knobs(d: int, causal: bool) -> tuple[int, int, int, bool, bool]:
    """(BLOCK_M, STAGES, DQ_N, DQ_SPLIT, DQ_TMA) of the Gluon backward: configs.GLUON_BWD, each overridable for sweeps
    through WARPFORGE_ATTN_GLUON_BWD_BLOCK_M / _STAGES / _DQ_N / _DQ_SPLIT / _DQ_TMA (scripts/bench_attention_gluon.py
    --bwd-sweep)."""
    block_m, stages, dq_n, dq_split, dq_tma = configs.GLUON_BWD[(d, bool(causal))]
    env = os.environ
    return (int(env.get("WARPFORGE_ATTN_GLUON_BWD_BLOCK_M", block_m)),
            int(env.get("WARPFORGE_ATTN_GLUON_BWD_STAGES", stages)), int(env.get("WARPFORGE_ATTN_GLUON_BWD_DQ_N", dq_n)),
            env.get("WARPFORGE_ATTN_GLUON_BWD_DQ_SPLIT", "1" if dq_split else "0") != "0",
            env.get("WARPFORGE_ATTN_GLUON_BWD_DQ_TMA", "1" if dq_tma else "0") != "0")


def gluon_bwd_key_rows(block_m: int, stages: int, dq_n: int, dq_split: bool, dq_tma: bool) -> int:
    """KEY_ROWS of the Gluon backward (configs.GLUON_BWD_KEY_ROWS, env WARPFORGE_ATTN_GLUON_BWD_KEY_ROWS: 0, 1 or 2);
    0 where the knobs cannot take it (ops/_gluon_flash_bwd.key_rows_knob)."""
    from .flash_gluon_bwd_kernel import key_rows_knob
    given = os.environ.get("WARPFORGE_ATTN_GLUON_BWD_KEY_ROWS", "")
    value = given or str(configs.GLUON_BWD_KEY_ROWS)
    if value not in ("0", "1", "2"):
        raise ValueError(f"WARPFORGE_ATTN_GLUON_BWD_KEY_ROWS takes 0, 1 or 2 (got {given!r})")
    return key_rows_knob(int(value), block_m, dq_split, dq_tma)


def gluon_bwd_group_split(d: int, group: int, block_m: int, stages: int, dq_n: int, dq_split: bool,
                          dq_tma: bool) -> int:
    """GQA: programs per (kv head, key block) of the Gluon backward at head dim d (configs.GLUON_BWD_GROUP_SPLIT, env
    WARPFORGE_ATTN_GLUON_BWD_GROUP_SPLIT; 0 = the whole group, one query head per program): the largest divisor of
    the group not above it. 1 (one program walks every head of the group) where the knobs cannot take a split (it
    needs dq_tma and stages · BLOCK_M >= 128)."""
    from .flash_gluon_bwd_kernel import group_split
    want = int(os.environ.get("WARPFORGE_ATTN_GLUON_BWD_GROUP_SPLIT", configs.GLUON_BWD_GROUP_SPLIT.get(d, 1)))
    return group_split(group, want, block_m, stages, dq_tma)


def gluon_bwd_gate(q, k, v, out, do, left, right, deterministic) -> bool:
    """Whether the batched backward takes the Hopper Gluon kernel (flash_gluon_bwd_kernel.py): an sm_90 device, a
    Triton in configs.GLUON_TRITON_VERSIONS, its own switch on (_gluon_bwd_switch), deterministic False (dq is summed
    by fp32 atomics), fp16/bf16, head dim 64 or 128 for q, k and v, no mask or causal (no window), TMA-aligned
    tensors. The caller has ruled out varlen, softcap, ALiBi and a separate V head dim; everything else runs the
    portable backward."""
    if deterministic or not (_gluon_shape_ok(q, k, left, right) and _gluon_bwd_switch()):
        return False
    from . import flash_gluon_bwd_kernel
    return flash_gluon_bwd_kernel.fits(q, k, v, out, do) and flash_gluon_bwd_kernel.available()


def _flash_bwd_fake(do, q, k, v, out, lse, cu_q, cu_k, batch, max_q, max_k, scale, left, right, softcap, slopes,
                    deterministic):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_flash_bwd = kernel_op("flash_attn_bwd", _flash_bwd_impl, _flash_bwd_fake)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, batch, max_q, max_k, scale, left, right, softcap, slopes, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, slopes)
    ctx.args = (batch, max_q, max_k, scale, left, right, softcap)
    ctx.deterministic = deterministic
    ctx.mark_non_differentiable(lse)


def _backward(ctx, d_out, d_lse):
    q, k, v, out, lse, cu_q, cu_k, slopes = ctx.saved_tensors
    dq, dk, dv = _flash_bwd(d_out, q, k, v, out, lse, cu_q, cu_k, *ctx.args, slopes, ctx.deterministic)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None


_flash_fwd = kernel_op("flash_attn_fwd", _flash_fwd_impl, _flash_fwd_fake, setup_context=_setup_context,
                       backward=_backward)


# ------------------------------------------------------------------------------------ public door
FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def check_qkv(q, k, v, rank: int, backend) -> None:
    """q, k, v as the attention kernels take them (the checks of flash_attention's door that ring attention shares):
    tensors of `rank` dims on one device, one float dtype (not bf16 on the interpreter), unit last stride, head dims
    multiples of 8 up to MAX_HEAD_DIM (v's may differ), k and v alike but for v's head dim, h_kv dividing h_q."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_rank(name, t, rank)
        check_same_device(name, t, "q", q)
    check_dtype("q", q, FLOATS)
    check_interpreted_matmul_dtype(backend, "q", q)
    check_same_dtype("k", k, "q", q)
    check_same_dtype("v", v, "q", q)
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_last_dim_contiguous(name, t)
    d = q.shape[-1]
    for name, width in (("q", d), ("v", v.shape[-1])):
        if width % 8 or not 8 <= width <= MAX_HEAD_DIM:
            fail(name, f"a head dim that is a multiple of 8 from 8 to {MAX_HEAD_DIM}", width)
    if k.shape[-1] != d:
        fail("k", f"head dim {d} (like q)", k.shape[-1])
    if k.shape[:-1] != v.shape[:-1]:
        fail("v", f"the shape of k but its head dim, {tuple(k.shape[:-1])} + (d_v,)", tuple(v.shape))
    h_q, h_kv = q.shape[-2], k.shape[-2]
    if h_kv == 0 or h_q % h_kv != 0:
        fail("k", f"a number of heads dividing q's {h_q}", h_kv)


def _validate(q, k, v, causal, softmax_scale, window, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              softcap, alibi_slopes, deterministic, return_lse, backend):
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t)
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    if varlen and (cu_seqlens_q is None or cu_seqlens_k is None):
        fail("cu_seqlens_q/cu_seqlens_k", "both given (varlen) or neither", "only one")
    check_qkv(q, k, v, 3 if varlen else 4, backend)
    if not varlen and k.shape[0] != q.shape[0]:
        fail("k", f"batch {q.shape[0]} (like q)", k.shape[0])
    if not varlen:
        for name, given in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            if given is not None:
                fail(name, "None unless cu_seqlens_q/cu_seqlens_k are given (varlen)", repr(given))
    check_bool("causal", causal)
    check_bool("return_lse", return_lse)
    check_window(window)
    check_positive_float("softmax_scale", softmax_scale)
    check_positive_float("softcap", softcap)
    check_bool("deterministic", deterministic)
    if alibi_slopes is not None:
        check_tensor("alibi_slopes", alibi_slopes)
        check_dtype("alibi_slopes", alibi_slopes, (torch.float32,))
        check_same_device("alibi_slopes", alibi_slopes, "q", q)
        batch, h_q = (cu_seqlens_q.numel() - 1) if varlen else q.shape[0], q.shape[-2]
        if tuple(alibi_slopes.shape) not in ((h_q,), (batch, h_q)):
            fail("alibi_slopes", f"fp32 [{h_q}] or [{batch}, {h_q}] (per query head)", tuple(alibi_slopes.shape))
        if alibi_slopes.requires_grad:
            fail("alibi_slopes", "a tensor that does not require grad (the slopes are constants; no backend "
                 "differentiates them)", "requires_grad=True")
        # bounded like every scale-like float: the kernel multiplies a slope by distances and log2(e) in fp32,
        # where a finite 3e38 is already inf (and inf - inf NaN); a NaN fails the comparison too
        if host_reads_allowed(alibi_slopes) and not read_once(
                (alibi_slopes,), ("bounded",), lambda: bool((alibi_slopes.abs() <= SCALE_MAX).all())):
            fail("alibi_slopes", f"finite slopes with |slope| <= {SCALE_MAX:g}", "NaN, inf or a larger slope")


def check_window(window) -> None:
    if not isinstance(window, (tuple, list)) or len(window) != 2 or \
            not all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window):
        fail("window", "(left, right) ints, each >= 0 or -1 for unbounded", window)


def band(causal: bool, window) -> tuple[tuple[int, int], tuple[int, int]]:
    """((left, right) for the reference, -1 unbounded; (left, right) for the kernels, unbounded as a distance past
    any sequence) of a validated causal flag and window."""
    left, right = (min(side, _UNBOUNDED) for side in window)  # sides past any sequence are unbounded
    if causal:
        right = 0
    return (left, right), (_UNBOUNDED if left < 0 else left, _UNBOUNDED if right < 0 else right)


def _plan_varlen(q, k, cu_q, cu_k, max_seqlen_q, max_seqlen_k):
    """(cu_seqlens_q, cu_seqlens_k, batch, max_q, max_k) of packed sequences. The offsets and the given max_seqlen
    are checked against the tensors on the host (one sync, once per offsets tensor while its values stay the same),
    except while a CUDA graph is captured or torch.compile traces: then both max_seqlen must be given and are
    trusted. Either way the kernels clamp the offsets into the tensors, so offsets that change unseen (written
    through numpy) or lie under capture can give wrong rows but never a read or write outside the tensors."""
    for name, given in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if given is not None:
            check_int(name, given, lo=0)
    check_cu_seqlens("cu_seqlens_q", cu_q, q, read_values=False)
    check_cu_seqlens("cu_seqlens_k", cu_k, k, read_values=False)
    cu_q, cu_k = cu_q.contiguous(), cu_k.contiguous()  # the kernels index them with stride 1
    batch = cu_q.numel() - 1
    if not host_reads_allowed(q):
        _check_same_count(cu_q, cu_k)
        if max_seqlen_q is None or max_seqlen_k is None:
            fail("max_seqlen_q/max_seqlen_k", "both given while capturing a CUDA graph or compiling (the offsets "
                 "cannot be read then)", (max_seqlen_q, max_seqlen_k))
        # more rows than the tensors hold would only grow the grid
        return cu_q, cu_k, batch, min(max_seqlen_q, q.shape[0]), min(max_seqlen_k, k.shape[0])

    def read():
        longest = []
        for name, cu, t, given in (("q", cu_q, q, max_seqlen_q), ("k", cu_k, k, max_seqlen_k)):
            host = check_cu_seqlens(f"cu_seqlens_{name}", cu, t)
            longest.append(int((host[1:] - host[:-1]).max()))
            if given is not None and given < longest[-1]:
                fail(f"max_seqlen_{name}", f">= the longest sequence ({longest[-1]})", given)
        return tuple(longest)
    max_q, max_k = read_once((cu_q, cu_k), (q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k), read)
    _check_same_count(cu_q, cu_k)
    return cu_q, cu_k, batch, max_q, max_k


def _check_same_count(cu_q, cu_k):
    if cu_q.numel() != cu_k.numel():
        fail("cu_seqlens_k", f"{cu_q.numel()} entries (like cu_seqlens_q)", cu_k.numel())


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    softmax_scale: Optional[float] = None, window: tuple[int, int] = (-1, -1),
                    cu_seqlens_q: Optional[torch.Tensor] = None, cu_seqlens_k: Optional[torch.Tensor] = None,
                    max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
                    softcap: Optional[float] = None, alibi_slopes: Optional[torch.Tensor] = None,
                    deterministic: bool = False, return_lse: bool = False,
                    backend: Optional[str] = None) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Softmax(scores) v, FlashAttention-style, scores = q kᵀ · scale (+ modifiers) under the mask.

    q [b, s_q, h_q, d], k [b, s_k, h_kv, d], v [b, s_k, h_kv, d_v] (h_q % h_kv == 0; d and d_v multiples of 8 up
    to 256, d_v may differ from d), or the packed varlen form q [total_q, h_q, d] with int32 cu_seqlens_q /
    cu_seqlens_k [batch + 1]. fp16, bf16 or fp32 (fp32 matmuls in full fp32 precision). causal aligns
    bottom-right; window = (left, right), -1 unbounded. softcap c > 0: scores become c · tanh(scores / c)
    (Gemma-2). alibi_slopes fp32 [h_q] or [b, h_q], each |slope| <= errors.SCALE_MAX: scores get
    − slope · |i + s_k − s_q − j| (flash-attn's ALiBi).
    A query that sees no key gets out 0 and lse -inf. Returns out [.., h_q, d_v] in q's dtype, and lse fp32
    ([b, h_q, s_q], varlen [h_q, total_q]) if return_lse.

    deterministic: the backward is bitwise reproducible. It already is with the default tiles (dq in its own pass,
    no atomics); True also rules out the atomic-dq variant a tile table may pick, and the Hopper Gluon backward
    (WARPFORGE_ATTN_GLUON_BWD), which sums dq by fp32 atomics (its dk and dv are reproducible).

    Varlen: the offsets (and max_seqlen_q/k, when given) are checked on the host: one sync, once per cu_seqlens
    tensor as long as its values do not change (the layers of a step share it). Under CUDA-graph capture or
    torch.compile nothing is read back: both max_seqlen must then be given and bound every sequence.
    """
    if isinstance(q, torch.Tensor):
        backend = resolve_backend(backend, q.device)
    _validate(q, k, v, causal, softmax_scale, window, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              softcap, alibi_slopes, deterministic, return_lse, backend)
    d = q.shape[-1]
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(d)
    ref_window, kernel_window = band(causal, window)
    varlen = cu_seqlens_q is not None
    if varlen:
        cu_seqlens_q, cu_seqlens_k, batch, max_q, max_k = _plan_varlen(q, k, cu_seqlens_q, cu_seqlens_k,
                                                                        max_seqlen_q, max_seqlen_k)
    else:
        batch, max_q, max_k = q.shape[0], q.shape[1], k.shape[1]

    if backend == "reference":
        kw = dict(softmax_scale=scale, window=ref_window, softcap=softcap, alibi_slopes=alibi_slopes)
        if varlen:
            out, lse = attention_varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, **kw)
        else:
            out, lse = attention_reference(q, k, v, **kw)
        return (out, lse) if return_lse else out

    # the backward allocates dq, dk, dv like q, k, v and writes them with a unit last stride
    q, k, v = dense_like(q), dense_like(k), dense_like(v)
    out, lse = _flash_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, batch, max_q, max_k, scale, *kernel_window,
                          float(softcap or 0.0), alibi_slopes, deterministic)
    return (out, lse) if return_lse else out
