"""Clipping + AdamW replayed from a CUDA graph steps exactly as the eager calls do."""
import pytest
import torch

from warpforge.models.gpt.optim_step import OptimizerStep


def _setup(device, graphed, log=print):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to(device)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=device.type == "cuda")
    return model, optim, OptimizerStep(list(model.parameters()), optim, 0.5, graphed=graphed, log=log)


def _run(device, graphed, steps=5, move_grads_at=None, log=print):
    model, optim, step = _setup(device, graphed, log)
    gen = torch.Generator(device="cpu").manual_seed(1)
    for i in range(steps):
        x = torch.randn(8, 16, generator=gen).to(device)
        model(x).square().mean().backward()
        if i == move_grads_at:  # as if the gradients had been written somewhere new
            for p in model.parameters():
                p.grad = p.grad.clone()
        step(1e-2 * (1 - i / steps))  # a schedule: the graph must read each step's lr
        optim.zero_grad(set_to_none=False if graphed else True)  # the same buffers each step
    return model, step


def test_eager_is_clip_then_adamw():
    model, step = _run(torch.device("cpu"), graphed=False, steps=2)
    ref, optim, _ = _setup(torch.device("cpu"), graphed=False)
    gen = torch.Generator(device="cpu").manual_seed(1)
    for i in range(2):
        ref(torch.randn(8, 16, generator=gen)).square().mean().backward()
        for g in optim.param_groups:
            g["lr"] = 1e-2 * (1 - i / 2)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        optim.step()
        optim.zero_grad()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b)
    state = step.state_dict()
    assert isinstance(state["param_groups"][0]["lr"], float) and state["param_groups"][0]["capturable"] is False


@pytest.mark.gpu
def test_graphed_matches_eager_on_gpu():
    dev = torch.device("cuda")
    eager, _ = _run(dev, graphed=False)
    graphed, step = _run(dev, graphed=True)
    assert step.graph is not None
    for a, b in zip(eager.parameters(), graphed.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    state = step.state_dict()  # a checkpoint loads into an eager optimizer
    assert isinstance(state["param_groups"][0]["lr"], float) and state["param_groups"][0]["capturable"] is False
    fresh = torch.optim.AdamW(graphed.parameters(), lr=1.0, fused=True)
    fresh.load_state_dict(state)


@pytest.mark.gpu
def test_graphed_falls_back_when_gradients_move():
    dev = torch.device("cuda")
    said = []
    eager, _ = _run(dev, graphed=False)
    moved, step = _run(dev, graphed=True, move_grads_at=3, log=said.append)
    assert step.graph is None and len(said) == 1
    for a, b in zip(eager.parameters(), moved.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
