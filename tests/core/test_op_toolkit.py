"""The op toolkit (ops/_op.py): under torch.compile the ops stay whole custom ops (no graph break, fake-tensor
tracing of the registered backward); eagerly they run through a plain autograd.Function over the same impls."""
import torch

import warpforge as wf
from warpforge.ops.rope import rope_tables
from warpforge.testing import device_under_test, rel_l2

DEV = device_under_test()


def test_compiled_matches_eager():
    """Same values and gradients compiled (fullgraph) and eager."""
    torch.manual_seed(0)
    x = torch.randn(6, 40, device=DEV, requires_grad=True)
    w = (1 + 0.1 * torch.randn(40, device=DEV)).requires_grad_()
    gu = torch.randn(6, 2, 4, 64, device=DEV, requires_grad=True)
    head = (0.1 * torch.randn(50, 40, device=DEV)).requires_grad_()
    targets = torch.randint(0, 50, (6,), device=DEV)
    cos, sin = rope_tables(2, 32, device=DEV)

    def step(x, w, gu, head):
        h = wf.rms_norm(x, w, backend="triton") + wf.layer_norm(x, w, w, backend="triton")
        y, h = wf.add_rms_norm(h, x, w, backend="triton")
        h = h + y
        r = wf.apply_rope(wf.swiglu(gu, backend="triton").view(6, 2, 4, 32), cos, sin, backend="triton")
        h = h + r.sum((1, 2))[:, :1]
        return wf.linear_cross_entropy(h, head, targets, backend="triton")

    inputs = (x, w, gu, head)
    eager = step(*inputs)
    eager_grads = torch.autograd.grad(eager, inputs)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager" if DEV.type == "cpu" else "inductor")
    got = compiled(*inputs)
    got_grads = torch.autograd.grad(got, inputs)
    assert torch.allclose(got, eager, rtol=1e-5, atol=1e-6)
    for a, b in zip(got_grads, eager_grads):
        assert rel_l2(a, b) <= 1e-5



def test_spy_launches_records_and_passes_through(monkeypatch):
    """testing.spy_launches (the Gluon tests' launch counters): sets and clears the environment, records what the
    record function picks of each call's arguments, returns the real function's result."""
    import os
    import types

    from warpforge.testing import spy_launches
    mod = types.SimpleNamespace(launch=lambda *args, **kwargs: sum(args) + kwargs.get("extra", 0))
    monkeypatch.setenv("WARPFORGE_SPY_TEST_KNOB", "3")
    calls = spy_launches(monkeypatch, mod, "launch", lambda args: args[1], {"WARPFORGE_SPY_TEST_GATE": "1"},
                         ("WARPFORGE_SPY_TEST_KNOB",))
    assert os.environ["WARPFORGE_SPY_TEST_GATE"] == "1" and "WARPFORGE_SPY_TEST_KNOB" not in os.environ
    assert mod.launch(1, 2, extra=10) == 13 and mod.launch(4, 5) == 9
    assert calls == [2, 5]
