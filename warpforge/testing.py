"""Helpers every family's tests use: error metrics, poisoned outputs, awkward shapes, the gpu marker."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

# Thresholds by dtype (DESIGN.md): relative L2 for fp32/fp16/bf16, cosine similarity for fp8/fp4.
REL_L2 = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
COSINE = {"fp8": 0.999, "fp4": 0.99}


_REL_L2_CHUNK = 1 << 26  # elements converted to float64 at a time (DeepSeek-V3's expert gradients: 7.5e9 of them)


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN anywhere in out gives inf. Large tensors go through in chunks, so
    that no float64 copy of the whole pair is made."""
    out, ref = torch.broadcast_tensors(out.detach(), ref.detach())
    out, ref = out.reshape(-1), ref.reshape(-1)
    num = den = 0.0
    for i in range(0, max(out.numel(), 1), _REL_L2_CHUNK):
        o, r = out[i:i + _REL_L2_CHUNK].double(), ref[i:i + _REL_L2_CHUNK].double()
        if not torch.isfinite(o).all():
            return float("inf")
        den += r.square().sum().item()
        num += (o - r).square().sum().item()
    num, den = num ** 0.5, den ** 0.5
    return num / den if den > 0 else num


def cosine(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double().flatten(), ref.detach().double().flatten()
    if not torch.isfinite(out).all():
        return float("-inf")
    return torch.nn.functional.cosine_similarity(out, ref, dim=0).item()


@contextlib.contextmanager
def poisoned_outputs() -> Iterator[None]:
    """Inside the block, torch.empty / torch.empty_like hand out NaN-filled float tensors (and -1 for
    ints), so an element a kernel forgets to write shows up as NaN instead of lucky zeros."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype not in (torch.bool,) and not t.is_complex():
            t.fill_(-1)
        return t

    torch.empty = lambda *a, **kw: poison(real_empty(*a, **kw))
    torch.empty_like = lambda *a, **kw: poison(real_empty_like(*a, **kw))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = real_empty, real_empty_like


def ragged_cu_seqlens(lengths: list[int], device="cpu") -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def captured(step):
    """(graph, step()'s tensors) of one CUDA-graph capture of step, not yet replayed: warmed up on a side stream
    first (its kernels compiled, its workspaces made), as torch's graph docs ask."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def graph_replayed(step):
    """step()'s tensors from one CUDA-graph capture of it (captured), replayed once. A step that runs autograd must
    not be captured while an earlier output still holds its graph (the captured backward would sync with the
    default stream: cudaErrorStreamCaptureImplicit); detach what it keeps."""
    graph, out = captured(step)
    graph.replay()
    torch.cuda.synchronize()
    return out


def device_under_test() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def dtypes_under_test() -> list[torch.dtype]:
    """bf16 is only trusted on a GPU: the interpreter's tl.dot on bf16 operands is wrong."""
    return [torch.float16, torch.bfloat16] if torch.cuda.is_available() else [torch.float16]


def assert_grads_match(fn, ref, inputs, dtype):
    """fn(*inputs) (outputs poisoned) against ref on fp32 copies: the value within the dtype's REL_L2 and the
    gradients of every input that requires one within 2e-2 (1e-4 in fp32)."""
    with poisoned_outputs():
        out = fn(*inputs)
    ref_in = [t.detach().float().requires_grad_(t.requires_grad) for t in inputs]
    want = ref(*ref_in)
    tol = max(REL_L2[dtype], 1e-5 if dtype == torch.float32 else 0)
    assert rel_l2(out, want) <= tol
    g = torch.randn_like(out) if out.dim() else torch.ones_like(out)
    got = torch.autograd.grad(out, [t for t in inputs if t.requires_grad], g)
    exp = torch.autograd.grad(want, [t for t in ref_in if t.requires_grad], g.float())
    for a, b in zip(got, exp):
        assert rel_l2(a, b) <= (2e-2 if dtype != torch.float32 else 1e-4)


def assert_qkv_grads_close(got, want, tol: float, what: str = "") -> None:
    """Attention gradients (dq, dk, dv) against a reference's: finite, and each within tol in relative L2."""
    for name, g, w in zip("qkv", got, want):
        assert torch.isfinite(g).all(), f"d{name}"
        assert rel_l2(g, w) <= tol, f"d{name} {what}".rstrip()


def triton_version() -> str:
    import triton
    return triton.__version__


def gluon_triton(versions: tuple[str, ...]) -> bool:
    """The installed Triton is one whose Gluon API a kernel was written for (its GLUON_TRITON_VERSIONS)."""
    return triton_version().startswith(versions)


def on_sm90_gluon(versions: tuple[str, ...]) -> bool:
    """A Hopper (sm_90) GPU and a Triton in `versions`: where a Gluon kernel's GPU tests can run."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and gluon_triton(versions)


def spy_launches(monkeypatch, module, name: str, record, env: dict[str, str] = None,
                 clear: tuple[str, ...] = ()) -> list:
    """Wrap module.<name> (a kernel's launcher that api dispatches to) so every call appends record(args) to the
    returned list and then runs as before; first set each env variable and delete those in `clear` (a gate
    switched on, its knob overrides off). The Gluon kernels' tests count their launches this way."""
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    for key in clear:
        monkeypatch.delenv(key, raising=False)
    calls = []
    real = getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(record(args))
        return real(*args, **kwargs)
    monkeypatch.setattr(module, name, spy)
    return calls
