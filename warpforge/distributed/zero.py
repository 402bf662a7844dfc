"""`ShardedAdamW`: AdamW with ZeRO stage 2's partitioning across the ranks of a process group.

Every rank keeps the full parameters (the forward and backward run as in DDP) but only 1/W of the reduced gradient
and of the optimizer state. The parameters are laid out in flat buckets (each parameter a view into its bucket);
as the backward finishes a bucket's gradients they are copied into a flat buffer and reduce-scattered
asynchronously, so the communication overlaps the rest of the backward, and each rank ends the backward holding
the averaged gradient of its shard of every bucket. step() updates the shards with AdamW and all-gathers them back
into every rank's parameters.

Buckets are reduced in one fixed order (a bucket is launched only after every bucket before it), so the
collectives line up across ranks even when the backward finishes buckets in different orders. The optimizer's
state_dict() gathers the shards (a collective: every rank calls it) into torch.optim.AdamW's own format, keyed by
parameter index, so a checkpoint moves freely between this optimizer and a plain AdamW run.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist

from ..errors import check_positive_float, fail
from .group import all_gather_into, reduce_scatter_into, resolve_group


# what a saved AdamW group carries over to the optimizer that loads it; its implementation flags (fused, foreach,
# capturable, differentiable) stay the loader's own
HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "initial_lr")


class _Bucket:
    """A run of parameters sharing one flat buffer (padded to a multiple of the world size), the buffer its
    gradients are gathered in during the backward, and this rank's shard of both."""

    def __init__(self, params: list[torch.nn.Parameter], world: int, rank: int):
        self.params = params
        self.offsets = []
        n = 0
        for p in params:
            self.offsets.append(n)
            n += p.numel()
        self.numel = n
        self.shard = -(-n // world)
        p0 = params[0]
        self.flat = torch.zeros(self.shard * world, dtype=p0.dtype, device=p0.device)
        for p, off in zip(params, self.offsets):
            self.flat[off:off + p.numel()].copy_(p.detach().reshape(-1))
            p.data = self.flat[off:off + p.numel()].view_as(p)  # the parameter lives in the bucket from now on
        self.lo = rank * self.shard
        self.param_shard = self.flat[self.lo:self.lo + self.shard]  # what this rank updates
        self.grad = None  # the full flat gradient, only between the first gradient and the reduce-scatter
        self.arrived = 0
        self.work = None
        self.grad_shard = torch.zeros(self.shard, dtype=p0.dtype, device=p0.device)


class ShardedAdamW:
    """AdamW (torch.optim.AdamW's update, decoupled weight decay on every parameter) with ZeRO-2 partitioning over
    `group` (default: the world). Use it in place of DDP + AdamW: do not wrap the model in DDP. One backward per
    step (no accumulation over several backwards); the gradients seen by step() are averaged over the ranks, as
    DDP's are. param_groups holds one group whose "lr" may be changed between steps. Parameters' .grad stay None:
    clip with clip_grad_norm_() here, not torch.nn.utils'.

    A parameter that no rank's backward reached in a step is left alone, as AdamW leaves a parameter whose grad is
    None: its values and moments keep (no weight decay), and one never reached has no state_dict entry. (Its bucket
    shares one step count, so a parameter that skips some steps and not others sees AdamW's bias correction of
    the bucket's count, not of its own.)

    bucket_mb: bytes of parameters per bucket (one reduce-scatter and one all-gather each); buckets are filled in
    reverse parameter order, the order in which the backward usually finishes them.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], *, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 group: Optional[dist.ProcessGroup] = None, bucket_mb: float = 25.0, foreach: Optional[bool] = None):
        grp = resolve_group(group, "the optimizer state is split over its ranks")
        check_positive_float("bucket_mb", bucket_mb)
        params = [p for p in params if p.requires_grad]
        if not params:
            fail("params", "at least one parameter that requires grad", "none")
        if len({p for p in params}) != len(params):
            fail("params", "each parameter once", "a parameter listed twice")
        dtype, device = params[0].dtype, params[0].device
        for p in params:
            if p.dtype != dtype or p.device != device or not p.dtype.is_floating_point:
                fail("params", f"floating-point parameters of one dtype and device ({dtype}, {device})",
                     f"{p.dtype} on {p.device}")
        self.group, self.rank, self.world = grp
        self.params = params
        self.buckets: list[_Bucket] = []
        cap = max(1, int(bucket_mb * 2 ** 20) // params[0].element_size())
        run: list[torch.nn.Parameter] = []
        for p in reversed(params):
            run.append(p)
            if sum(q.numel() for q in run) >= cap:
                self.buckets.append(_Bucket(run, self.world, self.rank))
                run = []
        if run:
            self.buckets.append(_Bucket(run, self.world, self.rank))
        self._index = {p: i for i, p in enumerate(params)}  # the optimizer's numbering (state_dict's keys)
        self._where = {}  # parameter -> (its bucket's index, its offset in the bucket)
        for bi, b in enumerate(self.buckets):
            for p, off in zip(b.params, b.offsets):
                self._where[p] = (bi, off)
                p.register_post_accumulate_grad_hook(self._grad_ready)
        self._launched = 0  # buckets [0, _launched) have their reduce-scatter under way or done
        # which parameters a gradient reached this step: here, then over every rank (_finish_reduce); and which
        # ever did (state_dict's entries)
        self._arrived = [False] * len(params)
        self._reached = torch.ones(len(params), dtype=torch.bool)
        self._ever = torch.zeros(len(params), dtype=torch.bool)
        shards = [b.param_shard for b in self.buckets]
        self.inner = torch.optim.AdamW(shards, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                       foreach=foreach)
        self.param_groups = self.inner.param_groups
        self._reduced = False

    # ------------------------------------------------------------------------------ the backward
    def _grad_ready(self, p: torch.nn.Parameter) -> None:
        """A parameter's gradient is complete: into its bucket's flat gradient, then launch what is ready."""
        bi, off = self._where[p]
        b = self.buckets[bi]
        if self._reduced or b.work is not None:
            raise RuntimeError("ShardedAdamW: a second backward before step() (accumulating gradients over "
                               "several backwards is not supported; call step() or zero_grad() between them)")
        if b.grad is None:
            b.grad = torch.zeros_like(b.flat)
        b.grad[off:off + p.numel()].copy_(p.grad.reshape(-1))
        self._arrived[self._index[p]] = True
        p.grad = None  # the only copy is the bucket's: that is the memory ZeRO-2 saves once reduced
        b.arrived += 1
        self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        """Launch the reduce-scatters of the complete buckets in bucket order (all of them when forced)."""
        while self._launched < len(self.buckets):
            b = self.buckets[self._launched]
            if not force and b.arrived < len(b.params):
                return
            if b.grad is None:  # no gradient reached any of its parameters on this rank
                b.grad = torch.zeros_like(b.flat)
            b.work = reduce_scatter_into(b.grad_shard, b.grad, group=self.group, async_op=True)
            self._launched += 1

    def _finish_reduce(self) -> None:
        """Wait for every bucket's reduced shard (launching any whose parameters got no gradient) and average it."""
        if self._reduced:
            return
        self._launch_ready(force=True)
        dev, everything = self.buckets[0].flat.device, all(self._arrived)
        # the usual step (every parameter reached here) makes its flags on the device: no host copy, no sync
        flags = (torch.ones(len(self.params), dtype=torch.int32, device=dev) if everything else
                 torch.tensor(self._arrived, dtype=torch.int32, device=dev))
        reached = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        for b in self.buckets:
            b.work.wait()
            b.work, b.grad = None, None
            b.grad_shard.div_(self.world)
        reached.wait()
        # read back (a host sync) only where this rank missed a parameter: else every rank's gradients reached all
        self._reached = torch.ones(len(self.params), dtype=torch.bool) if everything else flags.bool().cpu()
        self._reduced = True

    def _unreached_slices(self):
        """(bucket, slice of its shard) of each parameter that no rank's gradient reached this step, where the
        parameter overlaps this rank's shard."""
        for i in (~self._reached).nonzero().flatten().tolist():
            p = self.params[i]
            bi, off = self._where[p]
            b = self.buckets[bi]
            lo, hi = max(off, b.lo) - b.lo, min(off + p.numel(), b.lo + b.shard) - b.lo
            if lo < hi:
                yield b, slice(lo, hi)

    # ------------------------------------------------------------------------------ the step
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the (averaged, sharded) gradients so that their global L2 norm is at most max_norm; returns the
        norm before clipping (a collective: every rank calls it)."""
        self._finish_reduce()
        sq = torch.stack([b.grad_shard.float().pow(2).sum() for b in self.buckets]).sum()
        dist.all_reduce(sq, group=self.group)
        norm = sq.sqrt()
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for b in self.buckets:
            b.grad_shard.mul_(coef.to(b.grad_shard.dtype))
        return norm

    @torch.no_grad()
    def step(self) -> None:
        """The AdamW update of this rank's shards, then every bucket's parameters all-gathered from the ranks."""
        self._finish_reduce()
        for b in self.buckets:
            b.param_shard.grad = b.grad_shard
        # parameters no gradient reached: their values and moments as they were (AdamW skips a grad of None)
        kept = [(b, sl, {"param": b.param_shard[sl].clone(),
                         **{k: v[sl].clone() for k, v in self.inner.state.get(b.param_shard, {}).items()
                            if k != "step"}}) for b, sl in self._unreached_slices()]
        self.inner.step()
        for b, sl, old in kept:
            b.param_shard[sl] = old.pop("param")
            for k, v in self.inner.state[b.param_shard].items():   # moments first made by this step start at zero
                if k != "step":
                    v[sl] = old[k] if k in old else 0
        self._ever |= self._reached
        works = [all_gather_into(b.flat, b.param_shard.clone(), group=self.group, async_op=True) for b in self.buckets]
        for w in works:
            w.wait()
        for b in self.buckets:
            b.param_shard.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget this step's gradients (the next backward starts from none)."""
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
            b.work, b.grad, b.arrived = None, None, 0
            b.grad_shard.zero_()
        self._arrived = [False] * len(self.params)
        self._launched, self._reduced = 0, False

    # ------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """torch.optim.AdamW's state_dict format over self.params (index i = the i-th parameter), gathered from
        every rank's shards onto the CPU, one bucket at a time (the device holds one gathered bucket at most): a
        collective, every rank calls it and gets the same dict."""
        state: dict = {}
        if self.inner.state:
            for b in self.buckets:
                if b.param_shard not in self.inner.state:   # loaded without state for any of its parameters
                    continue
                step = self.inner.state[b.param_shard]["step"]
                for key in ("exp_avg", "exp_avg_sq"):
                    out = torch.empty_like(b.flat)
                    all_gather_into(out, self.inner.state[b.param_shard][key].contiguous(), group=self.group)
                    full = out.cpu()
                    del out
                    for p, off in zip(b.params, b.offsets):
                        if not self._ever[self._index[p]]:   # never reached: no entry, as AdamW
                            continue
                        entry = state.setdefault(self._index[p], {"step": step.detach().cpu().clone()})
                        entry[key] = full[off:off + p.numel()].view(p.shape).clone()
            state = dict(sorted(state.items()))
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.inner.param_groups]
        groups[0]["params"] = list(range(len(self.params)))
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, sd: dict) -> None:
        """Load a state_dict of this optimizer or of a plain torch.optim.AdamW over the same parameters (each rank
        keeps its shards). A parameter without an entry (one AdamW never stepped) starts with zero moments."""
        groups = sd["param_groups"]
        if len(groups) != 1 or len(groups[0]["params"]) != len(self.params):
            raise ValueError(f"ShardedAdamW: the state has {sum(len(g['params']) for g in groups)} parameters in "
                             f"{len(groups)} group(s), this optimizer {len(self.params)} in one")
        index = self._index
        ids = groups[0]["params"]
        inner_state = {}
        if sd["state"]:
            for b in self.buckets:
                s = {"step": None}
                for key in ("exp_avg", "exp_avg_sq"):
                    flat = torch.zeros_like(b.flat)
                    for p, off in zip(b.params, b.offsets):
                        entry = sd["state"].get(ids[index[p]])
                        if entry is None:
                            continue
                        if tuple(entry[key].shape) != tuple(p.shape):
                            raise ValueError(f"ShardedAdamW: a {key} of shape {tuple(entry[key].shape)} for a "
                                             f"parameter of shape {tuple(p.shape)}")
                        flat[off:off + p.numel()].copy_(entry[key].reshape(-1))
                        s["step"] = entry["step"]
                    s[key] = flat[b.lo:b.lo + b.shard].clone()
                if s["step"] is not None:   # else no parameter of the bucket has state: none, as for AdamW
                    inner_state[b] = s
        for g, saved in zip(self.inner.param_groups, groups):  # the hyperparameters, not how the writer ran
            g.update({k: v for k, v in saved.items() if k in HYPERPARAMETERS})
        self.inner.state.clear()
        self._ever = torch.tensor([ids[i] in sd["state"] for i in range(len(self.params))], dtype=torch.bool)
        for b, s in inner_state.items():
            step = s["step"]
            step = step.clone() if isinstance(step, torch.Tensor) else torch.tensor(float(step))
            self.inner.state[b.param_shard] = {"step": step, "exp_avg": s["exp_avg"], "exp_avg_sq": s["exp_avg_sq"]}

