"""flash_attention against the fp32 reference: forward, lse, gradients, varlen, windows, bad input.

On a CPU machine the kernels run through the Triton interpreter at small shapes; on a GPU the same
tests run compiled, in bf16 too, plus the larger shapes marked gpu.
"""
import pytest
import torch

import warpforge as wf
from warpforge import WarpforgeInputError
from warpforge.errors import SCALE_MAX
from warpforge.ops.attention import attention_reference, attention_varlen_reference
from warpforge.testing import (REL_L2, poisoned_outputs, ragged_cu_seqlens, rel_l2, device_under_test,
                               dtypes_under_test)

DEV = device_under_test()
DTYPES = dtypes_under_test()


def _inputs(b, s_q, s_k, h_q, h_kv, d, dtype, varlen_lengths=None, d_v=None):
    d_v = d_v or d
    if varlen_lengths is not None:
        lq, lk = varlen_lengths
        q = torch.randn(sum(lq), h_q, d, device=DEV, dtype=dtype)
        k = torch.randn(sum(lk), h_kv, d, device=DEV, dtype=dtype)
        v = torch.randn(sum(lk), h_kv, d_v, device=DEV, dtype=dtype)
    else:
        q = torch.randn(b, s_q, h_q, d, device=DEV, dtype=dtype)
        k = torch.randn(b, s_k, h_kv, d, device=DEV, dtype=dtype)
        v = torch.randn(b, s_k, h_kv, d_v, device=DEV, dtype=dtype)
    return [t.requires_grad_() for t in (q, k, v)]


def _check(q, k, v, *, causal=False, window=(-1, -1), cu=None, grads=True, **mods):
    """mods: softcap / alibi_slopes, passed to the op and the reference alike."""
    dtype = q.dtype
    kw = dict(causal=causal, window=window, **mods)
    if cu is not None:
        kw.update(cu_seqlens_q=cu[0], cu_seqlens_k=cu[1])
    with poisoned_outputs():
        out, lse = wf.flash_attention(q, k, v, return_lse=True, backend="triton", **kw)
    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
    if cu is None:
        ref_out, ref_lse = attention_reference(*ref_in, causal=causal, window=window, **mods)
    else:
        ref_out, ref_lse = attention_varlen_reference(*ref_in, cu[0], cu[1], causal=causal, window=window, **mods)
    tol = REL_L2[dtype]
    assert rel_l2(out, ref_out) <= tol
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "rows that see no key must have lse -inf"
    assert torch.all(lse[~finite] == float("-inf"))
    if finite.any():
        assert rel_l2(lse[finite], ref_lse[finite]) <= 1e-3
    if not grads:
        return
    d_out = torch.randn_like(out)
    with poisoned_outputs():
        grads_k = torch.autograd.grad(out, (q, k, v), d_out)
    grads_r = torch.autograd.grad(ref_out, ref_in, d_out.float())
    for name, g, r in zip(("dq", "dk", "dv"), grads_k, grads_r):
        err = rel_l2(g, r)
        assert err <= tol, f"{name}: rel L2 {err}"


CASES = [
    # b, s_q, s_k, h_q, h_kv, d, causal, window
    (2, 37, 37, 4, 4, 32, False, (-1, -1)),
    (2, 37, 37, 4, 2, 64, True, (-1, -1)),      # GQA 2:1, odd length
    (1, 1, 1, 2, 1, 32, True, (-1, -1)),        # length 1, MQA
    (1, 20, 45, 4, 1, 64, True, (-1, -1)),      # causal bottom-right, s_q < s_k
    (1, 45, 20, 2, 2, 32, True, (-1, -1)),      # s_q > s_k: leading rows see nothing
    (2, 33, 50, 2, 2, 32, False, (8, 3)),       # sliding window both sides
    (1, 48, 48, 2, 2, 64, True, (5, -1)),       # causal + left window
    (1, 40, 17, 2, 2, 96, True, (-1, -1)),      # padded head dim
    (1, 19, 23, 2, 2, 128, False, (-1, -1)),
    (1, 17, 17, 1, 1, 256, True, (-1, -1)),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}_q{}_k{}_h{}-{}_d{}_c{}_w{}".format(*c))
def test_dense_matches_reference(case, dtype):
    b, s_q, s_k, h_q, h_kv, d, causal, window = case
    _check(*_inputs(b, s_q, s_k, h_q, h_kv, d, dtype), causal=causal, window=window)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (6, 6))])
def test_varlen_matches_reference(causal, window, dtype):
    lq = [13, 0, 1, 33, 17]
    lk = [13, 5, 1, 40, 17]
    q, k, v = _inputs(None, None, None, 4, 2, 32, dtype, varlen_lengths=(lq, lk))
    cu = (ragged_cu_seqlens(lq, DEV), ragged_cu_seqlens(lk, DEV))
    _check(q, k, v, causal=causal, window=window, cu=cu)


def test_fully_masked_rows_give_zero_and_minus_inf():
    q, k, v = _inputs(1, 24, 8, 2, 2, 32, torch.float16)
    out, lse = wf.flash_attention(q, k, v, causal=True, return_lse=True, backend="triton")
    # bottom-right causal with s_q 24 > s_k 8: the first 16 queries see nothing
    assert torch.all(out[:, :16] == 0)
    assert torch.all(lse[:, :, :16] == float("-inf"))
    assert torch.isfinite(lse[:, :, 16:]).all()


def test_non_contiguous_heads_view():
    qkv = torch.randn(2, 21, 3, 4, 32, device=DEV, dtype=torch.float16)
    q, k, v = qkv.unbind(2)
    out = wf.flash_attention(q, k, v, causal=True, backend="triton")
    ref, _ = attention_reference(q.float(), k.float(), v.float(), causal=True)
    assert rel_l2(out, ref) <= 1e-2


def test_reference_backend_and_auto_dispatch_on_cpu():
    q, k, v = (torch.randn(1, 9, 2, 32) for _ in range(3))
    out = wf.flash_attention(q.half(), k.half(), v.half(), causal=True, backend="reference")
    ref, _ = attention_reference(q, k, v, causal=True)
    assert rel_l2(out, ref) <= 1e-2
    # auto on CPU tensors is the reference (fp32 allowed there)
    out32 = wf.flash_attention(q, k, v, causal=True)
    assert rel_l2(out32, ref) <= 1e-6


def test_torch_compile_no_graph_break():
    q, k, v = _inputs(1, 19, 19, 2, 1, 32, torch.float16)

    def step(q, k, v):
        return wf.flash_attention(q, k, v, causal=True, backend="triton").float().square().sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager" if DEV.type == "cpu" else "inductor")
    loss = compiled(q, k, v)
    loss.backward()
    ref = step(*[t.detach().clone() for t in (q, k, v)])
    assert torch.allclose(loss.detach(), ref, rtol=1e-3)
    assert q.grad is not None and torch.isfinite(q.grad).all()


def _bad(**over):
    q = torch.randn(1, 8, 4, 32, dtype=torch.float16, device=DEV)
    k = torch.randn(1, 8, 2, 32, dtype=torch.float16, device=DEV)
    v = torch.randn(1, 8, 2, 32, dtype=torch.float16, device=DEV)
    args = dict(q=q, k=k, v=v)
    args.update(over)
    return args


@pytest.mark.parametrize("over,name", [
    (dict(k=torch.randn(1, 8, 3, 32, dtype=torch.float16),
          v=torch.randn(1, 8, 3, 32, dtype=torch.float16)), "k"),                       # 4 % 3 heads
    (dict(q=torch.randn(1, 8, 4, 32, dtype=torch.float64)), "q"),                       # dtype
    (dict(v=torch.randn(1, 8, 2, 32, dtype=torch.bfloat16)), "v"),                      # dtype mismatch
    (dict(q=torch.randn(1, 8, 4, 50, dtype=torch.float16)), "q"),                       # head dim 50
    (dict(q=torch.randn(1, 8, 32, 4, dtype=torch.float16).transpose(-1, -2)), "q"),     # last dim stride
    (dict(k=torch.randn(1, 8, 2, 64, dtype=torch.float16),
          v=torch.randn(1, 8, 2, 64, dtype=torch.float16)), "k"),                       # head dim mismatch
    (dict(q=torch.randn(8, 4, 32, dtype=torch.float16)), "q"),                          # rank
    (dict(window=(3,)), "window"),
    (dict(softmax_scale=-1.0), "softmax_scale"),
    (dict(backend="cuda"), "backend"),
])
def test_bad_input_names_the_argument(over, name):
    args = _bad(**over)
    if DEV.type == "cuda":
        for key in ("q", "k", "v"):
            args[key] = args[key].to(DEV)
    with pytest.raises(WarpforgeInputError, match=rf"^{name}"):
        wf.flash_attention(args.pop("q"), args.pop("k"), args.pop("v"), backend=args.pop("backend", "triton"),
                           **args)


def test_bad_cu_seqlens():
    q = torch.randn(10, 2, 32, dtype=torch.float16, device=DEV)
    k = torch.randn(10, 2, 32, dtype=torch.float16, device=DEV)
    good = torch.tensor([0, 4, 10], dtype=torch.int32, device=DEV)
    for bad, name in [
        (torch.tensor([0, 6, 4, 10], dtype=torch.int32, device=DEV), "cu_seqlens_q"),   # not increasing
        (torch.tensor([0, 4, 9], dtype=torch.int32, device=DEV), "cu_seqlens_q"),       # wrong total
        (torch.tensor([0, 4, 10], dtype=torch.int64, device=DEV), "cu_seqlens_q"),      # dtype
    ]:
        with pytest.raises(WarpforgeInputError, match=rf"^{name}"):
            wf.flash_attention(q, k, k, cu_seqlens_q=bad, cu_seqlens_k=good, backend="triton")
    with pytest.raises(WarpforgeInputError, match="^cu_seqlens"):
        wf.flash_attention(q, k, k, cu_seqlens_q=good, backend="triton")


def test_wrong_device():
    if DEV.type != "cuda":
        pytest.skip("needs a second device type")
    q = torch.randn(1, 8, 2, 32, dtype=torch.float16, device="cuda")
    k = torch.randn(1, 8, 2, 32, dtype=torch.float16)
    with pytest.raises(WarpforgeInputError, match="^k"):
        wf.flash_attention(q, k, k)


# ------------------------------------------------------------------------------- GPU, real sizes
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", [
    (2, 1000, 1000, 16, 16, 128, True, (-1, -1)),
    (2, 777, 1500, 16, 2, 64, True, (-1, -1)),
    (1, 2049, 2049, 8, 1, 128, False, (256, 0)),
    (1, 513, 513, 4, 4, 256, True, (-1, -1)),
    (1, 300, 300, 4, 4, 96, False, (-1, -1)),
    (1, 4096, 4096, 8, 8, 128, False, (-1, -1)),
])
def test_gpu_large(case, dtype):
    b, s_q, s_k, h_q, h_kv, d, causal, window = case
    _check(*_inputs(b, s_q, s_k, h_q, h_kv, d, dtype), causal=causal, window=window)


@pytest.mark.gpu
def test_gpu_varlen_uneven():
    lq = [1, 1000, 37, 0, 513, 2048]
    q, k, v = _inputs(None, None, None, 8, 2, 128, torch.bfloat16, varlen_lengths=(lq, lq))
    cu = ragged_cu_seqlens(lq, DEV)
    _check(q, k, v, causal=True, cu=(cu, cu))


@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[4], CASES[5], CASES[6], CASES[8],
                                  (2, 64, 64, 4, 4, 64, False, (-1, -1)), (1, 70, 70, 2, 1, 128, False, (20, 5))],
                         ids=lambda c: "b{}_q{}_k{}_h{}-{}_d{}_c{}_w{}".format(*c))
def test_warp_specialized_forward(case, monkeypatch):
    """The Hopper forward (one warp-specialized loop over K/V descriptors, flash_ws_kernel.py) computes the
    portable kernel's function: out, lse and (through the shared backward) gradients; other head dims fall back."""
    from warpforge.ops.attention import configs
    # stages 2: at d 128 the table's 3-stage 128 x 128 tile does not fit beside the specialized partitions' buffers
    monkeypatch.setattr(configs, "TILES", configs.TILES.map(lambda t: t._replace(fwd=t.fwd._replace(ws=True, warps=4,
                                                                                                    stages=2))))
    b, s_q, s_k, h_q, h_kv, d, causal, window = case
    _check(*_inputs(b, s_q, s_k, h_q, h_kv, d, DTYPES[-1]), causal=causal, window=window)


@pytest.mark.parametrize("variant", ["tma", "atomic_dq", "tma_bwd"])
@pytest.mark.parametrize("case", [CASES[1], CASES[4], CASES[5], CASES[7], CASES[8],
                                  (1, 70, 70, 2, 1, 64, False, (20, 5))],
                         ids=lambda c: "b{}_q{}_k{}_h{}-{}_d{}_c{}_w{}".format(*c))
def test_kernel_variants(case, variant, monkeypatch):
    """The config switches (TMA descriptor loads, atomic dq) compute the same function."""
    from warpforge.ops.attention import configs
    passes = {"tma": [("fwd", "tma")], "atomic_dq": [("dkdv", "atomic_dq")],
              "tma_bwd": [("dkdv", "tma"), ("dq", "tma")]}[variant]
    for name, flag in passes:
        monkeypatch.setattr(configs, "TILES", configs.TILES.map(
            lambda t, n=name, f=flag: t._replace(**{n: getattr(t, n)._replace(**{f: True})})))
    b, s_q, s_k, h_q, h_kv, d, causal, window = case
    _check(*_inputs(b, s_q, s_k, h_q, h_kv, d, DTYPES[-1]), causal=causal, window=window)


@pytest.mark.parametrize("fwd, dkdv, dq, s_q, s_k, causal, window", [
    ((16, 32), (16, 16), (16, 16), 40, 1, True, (-1, -1)),     # forward: key tiles taller than query tiles
    ((16, 16), (16, 16), (16, 32), 40, 1, True, (-1, -1)),     # dq pass, the same
    ((16, 16), (32, 16), (16, 16), 1, 40, False, (0, 0)),      # dk/dv pass: query tiles taller than key tiles
    ((16, 32), (32, 16), (32, 16), 70, 9, True, (3, 0)),       # all three, a window
])
def test_uneven_tiles_with_rows_that_see_nothing(fwd, dkdv, dq, s_q, s_k, causal, window, monkeypatch):
    """Tiles a tuner may pick (the walked tile taller than the owned one) over rows that see no key: those rows'
    spans are empty (no unmasked walk from a negative row), out 0 and lse -inf there as in the reference."""
    from warpforge.ops.attention import configs
    C, T = configs.KernelCfg, configs.AttentionTiles
    monkeypatch.setattr(configs, "TILES", configs.TILES.map(lambda t: T(C(*fwd, 1, 1), C(*dkdv, 1, 1), C(*dq, 1, 1))))
    _check(*_inputs(1, s_q, s_k, 2, 1, 16, DTYPES[-1]), causal=causal, window=window)


def test_varlen_atomic_dq(monkeypatch):
    from warpforge.ops.attention import configs
    monkeypatch.setattr(configs, "TILES", configs.TILES.map(lambda t: t._replace(dkdv=t.dkdv._replace(atomic_dq=True))))
    lq = [13, 0, 1, 33]
    q, k, v = _inputs(None, None, None, 4, 2, 32, DTYPES[-1], varlen_lengths=(lq, lq))
    cu = ragged_cu_seqlens(lq, DEV)
    _check(q, k, v, causal=True, cu=(cu, cu))


def test_varlen_with_max_seqlen_is_sync_free_and_checks_types():
    lq = [9, 3]
    q, k, v = _inputs(None, None, None, 2, 2, 32, DTYPES[-1], varlen_lengths=(lq, lq))
    cu = ragged_cu_seqlens(lq, DEV)
    out = wf.flash_attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=9,
                             max_seqlen_k=9, backend="triton")
    ref, _ = attention_varlen_reference(q.float(), k.float(), v.float(), cu, cu, causal=True)
    assert rel_l2(out, ref) <= 1e-2
    with pytest.raises(WarpforgeInputError, match="^max_seqlen_q"):
        wf.flash_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=-1, max_seqlen_k=9,
                           backend="triton")
    with pytest.raises(WarpforgeInputError, match="^max_seqlen_k"):
        wf.flash_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_k=2, backend="triton")


# ------------------------------------------------------------------- softcap, ALiBi, head dims, d_v, determinism
@pytest.mark.parametrize("case", [
    dict(d=8), dict(d=40), dict(d=80), dict(d=104, causal=False), dict(d=192, d_v=128), dict(d=64, d_v=40),
    dict(d=32, softcap=5.0), dict(d=64, softcap=2.0, causal=False, window=(7, 3)),
    dict(d=32, alibi=True), dict(d=40, alibi="per batch", causal=False),
    dict(d=48, d_v=32, softcap=3.0, alibi=True, window=(9, -1)),
], ids=str)
def test_features(case):
    """Any head dim that is a multiple of 8, a V head dim of its own, tanh softcapping and ALiBi, alone and
    together, forward and gradients against the reference (odd lengths, GQA, s_q != s_k)."""
    case = dict(case)
    d, d_v = case.pop("d"), case.pop("d_v", None)
    causal, window = case.pop("causal", True), case.pop("window", (-1, -1))
    alibi = case.pop("alibi", None)
    b, h_q, h_kv = 2, 4, 2
    q, k, v = _inputs(b, 21, 37, h_q, h_kv, d, DTYPES[-1], d_v=d_v)
    if alibi:
        shape = (b, h_q) if alibi == "per batch" else (h_q,)
        case["alibi_slopes"] = torch.rand(shape, device=DEV) * 0.5
    _check(q, k, v, causal=causal, window=window, **case)


def test_features_varlen():
    lq = [13, 1, 30]
    q, k, v = _inputs(None, None, None, 4, 1, 40, DTYPES[-1], varlen_lengths=(lq, lq), d_v=24)
    cu = ragged_cu_seqlens(lq, DEV)
    _check(q, k, v, causal=True, cu=(cu, cu), softcap=4.0, alibi_slopes=torch.rand(3, 4, device=DEV))


def test_deterministic_backward_is_bitwise_reproducible(monkeypatch):
    """deterministic=True rules out the atomic-dq backward even where the tile table asks for it."""
    from warpforge.ops.attention import configs
    monkeypatch.setattr(configs, "TILES", configs.TILES.map(lambda t: t._replace(dkdv=t.dkdv._replace(atomic_dq=True))))
    q, k, v = _inputs(1, 40, 40, 4, 2, 32, DTYPES[-1])
    g = torch.randn(1, 40, 4, 32, device=DEV, dtype=DTYPES[-1])
    runs = [torch.autograd.grad(wf.flash_attention(q, k, v, causal=True, deterministic=True, backend="triton"),
                                (q, k, v), g) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("over,name", [
    (dict(softcap=0.0), "softcap"), (dict(softcap=-1.0), "softcap"), (dict(softcap=float("inf")), "softcap"),
    (dict(alibi_slopes=torch.ones(3)), "alibi_slopes"), (dict(alibi_slopes=torch.ones(4, dtype=torch.float16)),
                                                         "alibi_slopes"),
    (dict(v=torch.randn(1, 8, 2, 20, dtype=torch.float16)), "v"),        # d_v not a multiple of 8
    (dict(v=torch.randn(1, 9, 2, 32, dtype=torch.float16)), "v"),        # v's length differs from k's
    (dict(deterministic=1), "deterministic"),
])
def test_feature_arguments_refused(over, name):
    args = _bad(**over)
    if DEV.type == "cuda":
        args = {key: val.to(DEV) if isinstance(val, torch.Tensor) else val for key, val in args.items()}
    with pytest.raises(WarpforgeInputError, match=rf"^{name}"):
        wf.flash_attention(args.pop("q"), args.pop("k"), args.pop("v"), backend="triton", **args)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_alibi_slopes_bounded_like_scales(backend):
    """A finite but huge slope (3e38: inf once the kernel scales it in fp32, NaN on triton while the reference
    stayed finite) is refused on both backends, naming alibi_slopes, in either sign; |slope| up to SCALE_MAX runs
    and matches the reference."""
    q, k, v = (t.detach() for t in _inputs(2, 5, 7, 4, 2, 16, DTYPES[-1]))
    for slope in (3e38, -3e38, 1e31, float("inf"), float("nan")):
        slopes = torch.full((4,), slope, device=DEV)
        slopes[0] = 0.5  # one bad slope among good ones is enough
        with pytest.raises(WarpforgeInputError, match=r"^alibi_slopes.*1e\+30"):
            wf.flash_attention(q, k, v, alibi_slopes=slopes, backend=backend)
    slopes = torch.tensor([SCALE_MAX, -SCALE_MAX, 1.0, 0.0], device=DEV)
    out = wf.flash_attention(q, k, v, causal=True, alibi_slopes=slopes, backend=backend)
    ref = attention_reference(q, k, v, window=(-1, 0), alibi_slopes=slopes)[0]
    assert torch.isfinite(out).all() and rel_l2(out, ref) <= REL_L2[q.dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("d,d_v,softcap,alibi", [(80, 80, None, False), (192, 128, None, False),
                                                  (128, 128, 30.0, False), (128, 128, None, True),
                                                  (256, 256, 20.0, True)])
def test_gpu_features(d, d_v, softcap, alibi):
    q, k, v = _inputs(2, 700, 900, 8, 2, d, torch.bfloat16, d_v=d_v)
    mods = dict(softcap=softcap) if softcap else {}
    if alibi:
        mods["alibi_slopes"] = torch.rand(8, device=DEV) * 0.1
    _check(q, k, v, causal=True, **mods)
