"""Expert parallelism in the GPT's trainer (--expert-parallel): every MoE layer keeps num_experts / W experts per
process, tokens reach their experts by all-to-all (warpforge.distributed.shard_experts), and everything else stays DDP.

What changes around the step: DDP must not average the expert weights (each rank holds different ones), their
gradients already sum every rank's tokens and are divided by W to match DDP's average, and gradient clipping
takes one norm over all ranks' experts, so that every rank scales its replicated gradients alike. Checkpoints hold
full expert weights and optimizer state, gathered from the ranks, so a run resumes with or without the flag."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ...distributed.expert_parallel import shard_experts
from ...distributed.group import all_gather_into
from ...nn import MoE


def shard(model: torch.nn.Module) -> list[str]:
    """Shard every MoE layer's experts over the world (a collective setup; every rank calls it with the same
    weights); returns the names of the expert parameters."""
    names = []
    for mod_name, mod in model.named_modules():
        if isinstance(mod, MoE):
            shard_experts(mod)
            names += [f"{mod_name}.w13", f"{mod_name}.w2"]
    return names


def ddp_ignore(model: torch.nn.Module, names: list[str]) -> None:
    """DDP leaves these parameters alone (no bucket, no all-reduce)."""
    from torch.nn.parallel import DistributedDataParallel
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)


@torch.no_grad()
def average_grads(model: torch.nn.Module, names: list[str], world: int) -> None:
    """The experts' gradients sum the loss of every rank's tokens; DDP averages the others over the ranks."""
    params = dict(model.named_parameters())
    for n in names:
        if params[n].grad is not None:
            params[n].grad.div_(world)


@torch.no_grad()
def clip_grad_norm_(model: torch.nn.Module, names: list[str], max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over the whole model, the experts of every rank included: the same norm and
    scale on every rank. Returns the norm before clipping."""
    expert = set(names)
    grads = [(n in expert, p.grad) for n, p in model.named_parameters() if p.grad is not None]
    if not grads:
        return torch.zeros(())
    sq = [torch.zeros((), device=grads[0][1].device, dtype=torch.float32) for _ in range(2)]
    for is_expert, g in grads:
        sq[is_expert] += g.float().pow(2).sum()
    dist.all_reduce(sq[1])  # the experts' squares, from every rank
    norm = (sq[0] + sq[1]).sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for _, g in grads:
        g.mul_(coef.to(g.dtype))
    return norm


def _gather0(t: torch.Tensor) -> torch.Tensor:
    """Every rank's t, concatenated along dim 0, on the CPU (a collective; the device holds one gathered tensor at
    a time, so a checkpoint of the experts' weights and moments never sits whole on a GPU)."""
    t = t.contiguous()
    out = t.new_empty((t.shape[0] * dist.get_world_size(),) + tuple(t.shape[1:]))
    all_gather_into(out, t)
    return out.cpu()


def _expert_indices(model: torch.nn.Module, names: list[str]) -> dict[int, str]:
    """{index in model.parameters() (the optimizer's numbering): name} of the expert parameters."""
    expert = set(names)
    return {i: n for i, (n, _) in enumerate(model.named_parameters()) if n in expert}


def full_states(model: torch.nn.Module, optim: torch.optim.Optimizer, names: list[str]) -> tuple[dict, dict]:
    """(model, optimizer) state dicts with every expert tensor gathered to all E experts (a collective)."""
    model_state = dict(model.state_dict())
    for n in names:
        model_state[n] = _gather0(model_state[n])
    optim_state = optim.state_dict()
    state = dict(optim_state["state"])
    for i in _expert_indices(model, names):
        if i in state:
            state[i] = {k: (_gather0(v) if k in ("exp_avg", "exp_avg_sq") else v) for k, v in state[i].items()}
    return model_state, {**optim_state, "state": state}


def local_optim_state(model: torch.nn.Module, optim_state: dict, names: list[str]) -> dict:
    """A full optimizer state dict (full_states', or a run's without expert parallelism) cut to this rank's
    experts."""
    world, rank = dist.get_world_size(), dist.get_rank()
    state = dict(optim_state["state"])
    for i in _expert_indices(model, names):
        if i in state:
            cut = {}
            for k, v in state[i].items():
                if k in ("exp_avg", "exp_avg_sq"):
                    n = v.shape[0] // world
                    v = v[rank * n:(rank + 1) * n].clone()
                cut[k] = v
            state[i] = cut
    return {**optim_state, "state": state}
