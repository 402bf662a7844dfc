"""DDP and ZeRO-2 (`ShardedAdamW`) over gloo give one process's losses and weights: a small GPT trained a few steps on
a global batch, split over the ranks, against the same steps on the whole batch in one process (fp32, 1e-5)."""
import pytest
import torch
import torch.distributed as dist

from warpforge import WarpforgeInputError
from warpforge.distributed.zero import ShardedAdamW
from warpforge.models.gpt.config import GPTConfig
from warpforge.models.gpt.model import GPT

from .harness import run_ranks

CFG = GPTConfig(seq_len=16, n_layer=2, n_head=2, n_kv_head=2, d_model=32, vocab_size=64)
STEPS, BATCH, LR = 3, 4, 1e-2


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, CFG.vocab_size, (BATCH, CFG.seq_len + 1), generator=g) for _ in range(STEPS)]


def _model():
    torch.manual_seed(0)
    return GPT(CFG, backend="reference")


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.1)


def _one_process():
    model = _model()
    opt = _adamw(model.parameters())
    losses = []
    for xy in _batches():
        loss = model(xy[:, :-1], xy[:, 1:])
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses += [loss.item(), norm.item()]  # the norm: Adam's update alone would not see a wrong gradient scale
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def _ranks(rank, world, how, bucket_mb, device="cpu"):
    model = _model().to(device)
    if how == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model)
        opt = _adamw(model.parameters())
    else:
        net = model
        opt = ShardedAdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1, bucket_mb=bucket_mb)
    per = BATCH // world
    losses = []
    for xy in _batches():
        xy = xy[rank * per:(rank + 1) * per].to(device)
        loss = net(xy[:, :-1], xy[:, 1:])
        loss.backward()
        if how == "ddp":
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        else:
            norm = opt.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses += [mean.item() / world, norm.item()]
    out = {"losses": losses, "weights": {k: v.clone() for k, v in model.state_dict().items()}}
    if how == "zero2":
        out["state"] = opt.state_dict()  # a collective
        out["buckets"] = len(opt.buckets)
    return out


def _ranks_all(rank, world):
    # several bucket sizes in one launch: a bucket per few parameters, and one bucket for the whole model
    return {f"{how}-{mb}": _ranks(rank, world, how, mb) for how, mb in (("ddp", 25.0), ("zero2", 0.004),
                                                                         ("zero2", 25.0))}


@pytest.fixture(scope="module")
def one_process():
    return _one_process()


def test_ddp_and_zero2_match_one_process(one_process):
    losses, weights = one_process
    results = run_ranks(_ranks_all, 2)
    assert results[0]["zero2-0.004"]["buckets"] > 3 and results[0]["zero2-25.0"]["buckets"] == 1
    for name in results[0]:
        for r, res in enumerate(results):
            got = res[name]
            assert got["losses"] == pytest.approx(losses, abs=1e-5), (name, r)
            for k, w in weights.items():
                torch.testing.assert_close(got["weights"][k], w, atol=1e-5, rtol=0, msg=f"{name} rank {r} {k}")


def test_zero2_state_dict_is_adamw_format(one_process):
    """The gathered state loads into a plain AdamW over the same parameters, and equals the one-process state."""
    results = run_ranks(_state_only, 2)
    ref_model = _model()
    ref = _adamw(ref_model.parameters())
    for xy in _batches():
        ref_model(xy[:, :-1], xy[:, 1:]).backward()
        torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.5)
        ref.step()
        ref.zero_grad()
    want = ref.state_dict()
    for res in results:
        got = res
        assert set(got["state"]) == set(want["state"])
        for i, s in want["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(got["state"][i][key], s[key], atol=1e-6, rtol=1e-4)
            assert float(got["state"][i]["step"]) == float(s["step"])
        plain = _adamw(_model().parameters())
        plain.load_state_dict(got)  # the format torch's AdamW reads


def _state_only(rank, world):
    model = _model()
    opt = ShardedAdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1, bucket_mb=0.004)
    per = BATCH // world
    for xy in _batches():
        xy = xy[rank * per:(rank + 1) * per]
        model(xy[:, :-1], xy[:, 1:]).backward()
        opt.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()
    sd = opt.state_dict()
    # and back: a fresh optimizer on the same weights loads it, and its next gather is the same state
    again = ShardedAdamW(_model().parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1, bucket_mb=0.004)
    again.load_state_dict(sd)
    back = again.state_dict()
    for i in sd["state"]:
        assert torch.equal(back["state"][i]["exp_avg_sq"], sd["state"][i]["exp_avg_sq"])
    # a state a fused AdamW wrote (a GPU run) brings its hyperparameters, not its implementation flags
    fused = {**sd, "param_groups": [{**sd["param_groups"][0], "fused": True, "lr": 0.5}]}
    again.load_state_dict(fused)
    assert again.inner.param_groups[0]["fused"] is None and again.param_groups[0]["lr"] == 0.5
    return sd


def test_without_a_process_group_it_says_so():
    with pytest.raises(WarpforgeInputError, match="process group"):
        ShardedAdamW(_model().parameters())


def _with_unused(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(8, 8), torch.nn.Parameter(torch.ones(5))


def _unused_ranks(rank, world):
    lin, unused = _with_unused()
    # bucket_mb small enough that the unused parameter has a bucket of its own (4 buckets)
    opt = ShardedAdamW([unused, *lin.parameters()], lr=0.1, weight_decay=0.1, bucket_mb=1e-4)
    for step in range(2):
        lin(torch.full((2, 8), float(rank + step))).sum().backward()
        opt.step()
        opt.zero_grad()
    sd = opt.state_dict()
    again = ShardedAdamW([unused, *_with_unused()[0].parameters()], lr=0.1, weight_decay=0.1, bucket_mb=1e-4)
    again.load_state_dict(sd)   # no entry for the unused parameter: its bucket starts without state
    back = again.state_dict()
    return unused.detach().clone(), lin.weight.detach().clone(), sd, back


def test_zero2_leaves_parameters_no_gradient_reached():
    """A parameter no rank's backward reaches is left alone, as AdamW leaves a grad of None: no weight decay, no
    state entry; a plain AdamW's state without that entry loads (it used to raise KeyError)."""
    lin, unused = _with_unused()
    ref = torch.optim.AdamW([unused, *lin.parameters()], lr=0.1, weight_decay=0.1)
    for step in range(2):
        lin.zero_grad()
        (sum(lin(torch.full((2, 8), float(r + step))).sum() for r in range(2)) / 2).backward()   # the ranks' mean
        ref.step()
    want = ref.state_dict()
    for got_unused, got_w, sd, back in run_ranks(_unused_ranks, 2):
        assert torch.equal(got_unused, torch.ones(5))
        torch.testing.assert_close(got_w, lin.weight.detach(), atol=1e-6, rtol=1e-5)
        assert set(sd["state"]) == set(want["state"]) == {1, 2} and set(back["state"]) == {1, 2}
        for i in (1, 2):
            torch.testing.assert_close(sd["state"][i]["exp_avg"], want["state"][i]["exp_avg"], atol=1e-6, rtol=1e-5)
