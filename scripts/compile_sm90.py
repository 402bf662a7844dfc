"""Compile warpforge's kernels for sm_90 on a machine without a GPU and report what the compiler made of them:
warps, shared memory, registers and spills (ptxas -v), and whether the PTX holds wgmma, TMA copies and setmaxnreg.

    python scripts/compile_sm90.py [--family attention,mla,moe,norm] [--ptx-dir DIR]

How: Triton's driver is pointed at a stub sm_90 target and every kernel launch becomes a compile-only warmup,
so each family's own launch code runs on CPU tensors and compiles exactly the kernels (and configs) it would
launch on an H100/H200. ptxas ships in the Triton wheel. Nothing runs, so numbers are checked by the GPU tests.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

COMPILED = []


class _StubDriver:
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def _compile_only():
    """Every JITFunction launch compiles (warmup) instead of running, and the result is recorded."""
    real_run = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        kernel = real_run(self, *args, grid=grid, warmup=True, **kwargs)
        COMPILED.append((self.fn.__name__, kernel))
        return kernel
    JITFunction.run = run
    driver.set_active(_StubDriver())


def _cuda_everywhere():
    """The launchers ask about the device (SM count, arch); answer as an H200 would."""
    import importlib
    importlib.import_module("warpforge.ops.moe.align")  # every module loaded, so that all can be patched
    stubs = {"arch_key": lambda device: "sm90", "sm_count": lambda device: 132,
             "resolve_backend": lambda backend, device: "triton"}
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("warpforge"):
            for name, stub in stubs.items():
                if hasattr(mod, name):
                    setattr(mod, name, stub)


def _ptxas(ptx: str) -> str:
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        for ptxas in ("ptxas", "ptxas-blackwell"):  # newer Tritons write PTX only their second ptxas reads
            out = subprocess.run([os.path.join(bin_dir, ptxas), "-arch=sm_90a", "-v", path, "-o",
                                  os.path.join(tmp, "k.cubin")], capture_output=True, text=True)
            if out.returncode == 0:
                break
    regs = re.search(r"Used (\d+) registers", out.stderr)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out.stderr)
    return (f"regs {regs.group(1) if regs else '?'}"
            + (f", spills {spill.group(1)}/{spill.group(2)} B" if spill else "")
            # C7515 / C7510 and kin: ptxas serialized the wgmma pipeline (a large loss; see benchmarks/NOTES.md)
            + (", WGMMA SERIALIZED" if "wgmma.mma_async instructions are serialized" in out.stderr else ""))


def attention():
    from warpforge.ops.attention import api
    for d in (64, 128):
        q, k, v = (torch.randn(2, 256, 4, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        out = api._flash_fwd_impl(q, k, v, None, None, 2, 256, 256, 0.1, 1 << 30, 0, 0.0, None, False)[0]
        api._flash_bwd_impl(torch.randn_like(out), q, k, v, out, torch.zeros(2, 4, 256), None, None, 2, 256, 256,
                            0.1, 1 << 30, 0, 0.0, None, False)
    # the score modifiers and a V head dim of its own (DeepSeek's 192 / 128)
    q, k = (torch.randn(2, 256, 4, 192, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(2, 256, 4, 128, dtype=torch.bfloat16)
    slopes = torch.rand(4)
    out = api._flash_fwd_impl(q, k, v, None, None, 2, 256, 256, 0.1, 1 << 30, 0, 30.0, slopes, False)[0]
    api._flash_bwd_impl(torch.randn_like(out), q, k, v, out, torch.zeros(2, 4, 256), None, None, 2, 256, 256, 0.1,
                        1 << 30, 0, 30.0, slopes, False)
    attention_ws()


def attention_ws():
    from warpforge.ops.attention import api, configs
    table = configs.TILES
    try:  # the warp-specialized forward, whatever the table says today
        for d, bn in ((64, 128), (128, 128), (128, 64)):
            configs.TILES = table.map(lambda t: t._replace(fwd=t.fwd._replace(block_m=128, block_n=bn, warps=4,
                                                                                 stages=2, ws=True)))
            q, k, v = (torch.randn(2, 256, 4, d, dtype=torch.bfloat16) for _ in range(3))
            api._flash_fwd_impl(q, k, v, None, None, 2, 256, 256, 0.1, 1 << 30, 0, 0.0, None, False)
    finally:
        configs.TILES = table


def attention_fp8():
    from warpforge.ops.attention import fp8_api
    # e4m3's defaults (q's residual codes, per-block k scales: their quantiser kernels and the Q_LO kernel) and the
    # single-code kernel (per-row scales, no residual) that q_residual=False, k_block=0 asks for
    single = dict(q_residual=False, k_block=0)
    for d, fmt, extra in ((64, "fp8", single), (128, "fp8", {}), (128, "fp8", single), (128, "int8", {}),
                          (256, "fp8", {})):
        q, k, v = (torch.randn(2, 256, 4, d, dtype=torch.bfloat16) for _ in range(3))
        x = fp8_api.quantize_qkv(q, k, v, qk_format=fmt, **extra)  # the Triton quantiser (compiled, not run: x is empty)
        fp8_api._fp8_impl(x.q, x.q_scale, x.k, x.k_scale, x.v_t, x.v_scale, fmt, torch.bfloat16, 0.1, 1 << 30, 0,
                          x.q_lo, x.k_block)


def mla():
    from warpforge.ops import mla as mla_ops
    for h_q, fmt in ((16, "bf16"), (128, "bf16"), (16, "fp8"), (16, "nvfp4")):
        q = torch.randn(4, 1, h_q, 576, dtype=torch.bfloat16)
        latent = torch.randn(8, 64, 1, 576, dtype=torch.bfloat16)
        scale = mla_ops.nvfp4_tensor_scale(latent) if fmt == "nvfp4" else None
        cache = mla_ops.quantize_kv(latent, fmt, scale)
        table = torch.arange(8, dtype=torch.int32).view(4, 2)
        plan = mla_ops.plan(q, cache, table, kv_format=fmt)
        from warpforge.ops.mla.api import _mla_decode_impl
        _mla_decode_impl(q, cache, table, torch.full((4,), 100, dtype=torch.int32), scale, plan.softmax_scale,
                         False, fmt, plan.num_splits, list(plan.config))
    # quantized caches at 64+ rows on sm_90: their pages dequantised into bf16 scratch (the Gluon kernel then runs;
    # it compiles in tests/mla/test_mla_gluon.py)
    from warpforge.ops.mla import dequant_kernel
    for fmt in ("fp8", "nvfp4", "mxfp4"):
        f = mla_ops.KV_FORMATS[fmt]
        cache = torch.zeros(8, 64, 1, f.width, dtype=torch.uint8)
        dequant_kernel.mla_decode_dequantized(torch.zeros(4, 1, 128, 576, dtype=torch.bfloat16), cache,
                                              torch.zeros(4, 2, dtype=torch.int32), torch.zeros(4, dtype=torch.int32),
                                              torch.ones(1), f, lambda *a: (None, None), 4,
                                              mla_ops.configs.DequantCfg(2, 8))


def evoformer():
    from warpforge.ops.evoformer import api
    for s, d in ((8, 32), (8, 16), (4, 64)):
        q, k, v, gate = (torch.randn(1, s, 384, 8, d, dtype=torch.bfloat16) for _ in range(4))
        pair = torch.randn(1, 1, 8, 384, 384, dtype=torch.bfloat16)
        mask = torch.zeros(1, s, 1, 1, 384, dtype=torch.bfloat16)
        out, lse = api._fwd_impl(q, k, v, mask, pair, gate, 0.1)
        from warpforge.ops.evoformer.evoformer_kernel import evoformer_bwd
        full = (1, s, 8, 384, 384)
        evoformer_bwd(torch.randn_like(q), q, k, v, q, torch.zeros(2, 1, s, 8, 384), (api._full(mask, full),
                      api._full(pair, full)), gate, 0.1, True, api._tiles(q))
        evoformer_bwd(torch.randn_like(q), q, k, v, q, torch.zeros(2, 1, s, 8, 384), (api._full(mask, full),
                      api._full(pair, full)), gate, 0.1, False, api._tiles(q), fused=True)


def paged():
    from warpforge.ops import paged as paged_ops
    from warpforge.ops.paged.api import _append_slots_impl, _decode_impl
    b, h_q, h_kv, page, pages = 4, 32, 8, 16, 64
    # the tuned shapes first, then head dims that are not powers of two (80, 96 in 128-wide tiles, 192 in 256) and
    # s_q 16 (GQA 4 · 16 = 64 rows)
    for d, fmt, s_q in ((128, "bf16", 1), (128, "fp8", 1), (128, "nvfp4", 1), (128, "mxfp4", 1), (64, "bf16", 4),
                        (256, "bf16", 1), (80, "bf16", 1), (96, "fp8", 1), (96, "nvfp4", 1), (96, "mxfp4", 1),
                        (192, "bf16", 1), (128, "bf16", 16), (128, "fp8", 16)):
        q = torch.randn(b, s_q, h_q, d, dtype=torch.bfloat16)
        values = torch.randn(pages, page, h_kv, d, dtype=torch.bfloat16)
        cache, scale = paged_ops.quantize_kv(values, fmt) if fmt != "bf16" else (values, None)
        table = torch.arange(pages, dtype=torch.int32).view(b, -1)
        plan = paged_ops.plan(q, cache, table, kv_format=fmt)
        _decode_impl(q, cache, cache, None, None, table, torch.full((b,), 100, dtype=torch.int32), scale, scale, fmt,
                     plan.softmax_scale, 0.0, -1, plan.num_splits, list(plan.config))
        if paged_ops.KV_FORMATS[fmt].fp4:   # the same bytes as a pair (values, block scales): 16-byte value copies
            pair = [t.contiguous() for t in (cache[..., :d // 2], cache[..., d // 2:])]
            _decode_impl(q, pair[0], pair[0], pair[1], pair[1], table, torch.full((b,), 100, dtype=torch.int32), scale,
                         scale, fmt, plan.softmax_scale, 0.0, -1, plan.num_splits, list(plan.config))
    # append_kv_slots: the cache writer of every format
    for d, fmt in ((128, "bf16"), (128, "fp8"), (128, "nvfp4"), (128, "mxfp4"), (256, "nvfp4")):
        kv = paged_ops.KV_FORMATS[fmt]
        cache = torch.zeros(pages, page, h_kv, kv.width(d), dtype=kv.storage)
        new = torch.randn(64, h_kv, d, dtype=torch.bfloat16)
        scale = torch.ones(1) if fmt in ("fp8", "nvfp4") else None
        _append_slots_impl(cache, cache.clone(), None, None, new, new, torch.arange(64), scale, scale, fmt)


def moe():
    from warpforge.ops.moe import api
    e, h, i = 8, 1024, 512
    w13 = torch.randn(e, 2 * i, h, dtype=torch.bfloat16)
    w2 = torch.randn(e, h, i, dtype=torch.bfloat16)
    for t in (16, 4096):
        hidden = torch.randn(t, h, dtype=torch.bfloat16)
        ids = torch.randint(0, e, (t, 2), dtype=torch.int32)
        api._experts_fwd_impl(hidden, w13, w2, torch.rand(t, 2), ids, False)
    # FP8 weights (e4m3 bytes, a scale per 128 x 128 block), dequantised through fp32 and (WARPFORGE_MOE_FP8_FP16)
    # to fp16 with the MMA in fp16
    q13, q2 = (torch.zeros(w.shape, dtype=torch.uint8) for w in (w13, w2))
    s13, s2 = (torch.ones(e, -(-w.shape[1] // 128), -(-w.shape[2] // 128)) for w in (w13, w2))
    for fp16 in ("0", "1"):
        os.environ["WARPFORGE_MOE_FP8_FP16"] = fp16
        for t in (1, 128):
            hidden = torch.randn(t, h, dtype=torch.bfloat16)
            ids = torch.randint(0, e, (t, 2), dtype=torch.int32)
            api._experts_fp8_impl(hidden, q13, q2, s13, s2, torch.rand(t, 2), ids)
    del os.environ["WARPFORGE_MOE_FP8_FP16"]
    # the one-launch decode kernel (decode_kernel.py) at its A/B tile, bf16 and FP8 weights
    os.environ["WARPFORGE_MOE_DECODE"] = "1"
    hidden, ids = torch.randn(1, h, dtype=torch.bfloat16), torch.randint(0, e, (1, 2), dtype=torch.int32)
    api._experts_decode_impl(hidden, w13, w2, torch.rand(1, 2), ids, None, None)
    api._experts_decode_impl(hidden, q13, q2, torch.rand(1, 2), ids, s13, s2)
    del os.environ["WARPFORGE_MOE_DECODE"]
    moe_sorted()


def moe_sorted():
    """The training-size path (ops/moe/sorted_kernel.py), forward and backward, as the table has it and with the
    down, d act and weight-gradient tiles warp-specialized (4 warps; gate/up cannot be), whatever the table's
    default (WARPFORGE_MOE_SORTED=1)."""
    from warpforge.ops.moe import api, configs
    e, h, i, t = 8, 1024, 512, 4096
    w13 = torch.randn(e, 2 * i, h, dtype=torch.bfloat16)
    w2 = torch.randn(e, h, i, dtype=torch.bfloat16)
    hidden = torch.randn(t, h, dtype=torch.bfloat16)
    ids = torch.randint(0, e, (t, 2), dtype=torch.int32)
    weights = torch.rand(t, 2)
    table, switch = configs.SORTED, os.environ.get("WARPFORGE_MOE_SORTED")
    os.environ["WARPFORGE_MOE_SORTED"] = "1"

    def ws(cfg):  # 4 warps (specialization happens only there); the wgrad's 128 x 256 tiles fit 2 stages
        tiles = {f: getattr(cfg, f) for f in ("down", "dact", "wgrad")} if cfg else {}  # gate/up: never
        return cfg and cfg._replace(**{f: t._replace(warps=4, stages=2 if f == "wgrad" else 3, ws=True)
                                       for f, t in tiles.items() if t is not None})
    try:
        for variant in (table, table.map(ws)):
            configs.SORTED = variant
            out, act, pre, sorted_ids, expert_ids, num_post = api._experts_fwd_impl(hidden, w13, w2, weights, ids,
                                                                                     True)
            api._experts_bwd_impl(torch.randn_like(out), hidden, w13, w2, weights, act, pre, sorted_ids, expert_ids,
                                  num_post, 2)
    finally:
        configs.SORTED = table
        if switch is None:
            os.environ.pop("WARPFORGE_MOE_SORTED")
        else:
            os.environ["WARPFORGE_MOE_SORTED"] = switch


def norm():
    from warpforge.ops.norm import api
    x = torch.randn(64, 768, dtype=torch.bfloat16)
    w = torch.ones(768, dtype=torch.bfloat16)
    y, mean, rstd = api._norm_fwd_impl(x, w, None, 1e-6, False, None)
    api._norm_bwd_impl(torch.randn_like(y), x, w, mean, rstd, False)


def monarch():
    from warpforge.ops.monarch import api
    t = 256  # tiles depend on the config, not the token count (above one tile)
    # d 1024 / nb 16: 64-wide blocks, where the weight gradient that sums the bias takes another path
    for d, nb, dtype in ((4096, 4, torch.bfloat16), (4096, 16, torch.bfloat16), (1024, 16, torch.bfloat16),
                         (4096, 4, torch.float32)):
        x = torch.randn(t, d, dtype=dtype)
        w_right, w_left = (torch.randn(nb, d // nb, d // nb, dtype=dtype) for _ in range(2))
        y, g, w_runs = api._fwd_impl(x, w_left, w_right, torch.zeros(d, dtype=dtype))
        api._bwd_impl(torch.randn_like(y), x, w_left, w_right, g, w_runs, True)
        api._fwd_impl(x, w_left, w_right, None)  # the L GEMM without a bias


def sparse():
    from warpforge.ops.sparse import api
    from warpforge.ops.sparse.select import blocks_per_sequence, canonical
    from warpforge.ops.sparse.sparse_kernel import kept_by
    b, s, bs = 1, 1024, 128
    for d, h_q, h_kv in ((128, 16, 2), (64, 8, 8)):
        q = torch.randn(b, s, h_q, d, dtype=torch.bfloat16)
        k, v = (torch.randn(b, s, h_kv, d, dtype=torch.bfloat16) for _ in range(2))
        iq, ik = torch.randn(b, s, h_kv, 32, dtype=torch.bfloat16), torch.randn(b, s, 1, 32, dtype=torch.bfloat16)
        api._scores_impl(iq, ik, None, b, s, bs, True, 0.1)
        idx = torch.randint(-1, s // bs, (b, h_kv, s // bs, 16), dtype=torch.int32)
        sel, n_sel = canonical(idx, blocks_per_sequence(None, b, s, bs, "cpu"), True)
        out, lse = api._fwd_impl(q, k, v, sel, n_sel, None, b, s, bs, True, 0.1)
        api._bwd_impl(torch.randn_like(out), q, k, v, out, torch.zeros(b, h_q, s), sel, n_sel, None, b, s, bs, True,
                      0.1)
        api._stats_impl(q, k, torch.zeros(b, h_q, s), iq, ik, sel, n_sel, None, b, s, bs, True, 0.1)
        kept_by(sel, s // bs, False)  # the non-causal walk of the lists (the backward above took the causal one)


FAMILIES = {"attention": attention, "attention_ws": attention_ws, "attention_fp8": attention_fp8, "mla": mla, "moe": moe,
            "moe_sorted": moe_sorted,
            "norm": norm, "paged": paged, "evoformer": evoformer, "monarch": monarch,
            "sparse": sparse}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default=",".join(FAMILIES), help="comma-separated, of " + ", ".join(FAMILIES))
    ap.add_argument("--ptx-dir", default=None, help="also write each kernel's PTX here")
    args = ap.parse_args()
    _compile_only()
    _cuda_everywhere()
    failed = 0
    for name in args.family.split(","):
        COMPILED.clear()
        try:
            FAMILIES[name]()
        except Exception as exc:  # noqa: BLE001 - report and go on to the next family
            failed += 1
            print(f"{name}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
        for i, (kname, k) in enumerate(COMPILED):
            ptx = k.asm.get("ptx", "")
            feats = [f for f, tag in (("wgmma", "wgmma.mma_async"), ("tma", "cp.async.bulk.tensor"),
                                      ("setmaxnreg", "setmaxnreg"), ("cp.async", "cp.async.cg"),
                                      ("e4m3 mma", ".e4m3.e4m3"), ("s8 mma", ".s8.s8")) if tag in ptx]
            ws = "warp-specialized, " if "ttg.warp_specialize" in k.asm.get("ttgir", "") else ""
            print(f"{name}: {kname} warps {k.metadata.num_warps} smem {k.metadata.shared} B, {ws}{_ptxas(ptx)}, "
                  f"ptx has {feats}")
            if args.ptx_dir:
                os.makedirs(args.ptx_dir, exist_ok=True)
                with open(os.path.join(args.ptx_dir, f"{name}-{i}-{kname}.ptx"), "w") as f:
                    f.write(ptx)
    print(f"triton {triton.__version__}: {'all compiled' if not failed else f'{failed} family(ies) failed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
