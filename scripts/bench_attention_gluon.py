"""Dense attention forward on an H200: the Hopper Gluon kernel (ops/attention/flash_gluon_kernel.py), the portable
Triton kernel and cuDNN SDPA, in one process on the same data.

    PYTHONPATH=. python scripts/bench_attention_gluon.py [--sweep] [--sweep-only] [--json out.json]

Cases (bf16): b4 h16 s8192 d128 causal and non-causal, b32 h16 s1024 d128 causal, b8 h32 s4096 d64 causal.
Per case and path: ms (triton.testing.do_bench median; each call takes the next of a rotation of input sets that
together pass 2x the L2, so L2 does not serve them), TFLOP/s (4 · b · h · s² · d, halved when causal), the ratio
to cuDNN, and the max abs error against SDPA's output. cuDNN runs through
torch.nn.attention.sdpa_kernel(SDPBackend.CUDNN_ATTENTION) on [b, h, s, d] views of the same tensors.
--sweep: the Gluon kernel's knobs (BLOCK_N 64/128 x ring stages x ping-pong on/off x persistent) on the causal
cases, called directly. 128 query rows per work item (two 64-row consumer warpgroups) is fixed by the register
budget, and BLOCK_N 176 is not a TMA box Triton accepts (boxes are powers of two).

    PYTHONPATH=. python scripts/bench_attention_gluon.py --bwd [--bwd-sweep] [--json out.json]

--bwd: forward+backward (the backward of ops/attention/flash_gluon_bwd_kernel.py) at the attention bench's fwd+bwd cases
(b4 h16 s8192 d128, b32 h16 s1024, b1 h16 s32768, b8 h32 s4096 d64, b4 h32/kv4 s8192 GQA 8:1; all causal): "gluon+gluon"
(Gluon forward, Gluon backward), "gluon+portable" (Gluon forward, portable backward), "cudnn" (cuDNN SDPA, GQA through
kv expanded once outside the timing, as the main bench does) and "gluon fwd" (the forward alone: backward time = fwd+bwd
minus fwd). Each call runs out = attention(q, k, v) and torch.autograd.grad(out, (q, k, v), do) on the next of a
rotation of input sets (2x the L2); TFLOP/s count 3.5x the forward's (backward 2.5x); errors are the max rel L2 of dq,
dk, dv against cuDNN's. --bwd-sweep: the backward's knobs (BLOCK_M, STAGES, DQ_N, DQ_SPLIT, DQ_TMA) on the headline, b32
s1024 and d64 cases, through the WARPFORGE_ATTN_GLUON_BWD_* variables (KEY_ROWS: the table's where a sweep's knobs take
it, else 0). --bwd-cases 0,3: only those of BWD_CASES (indices; default all). --key-rows: also the backward's transposed
step (KEY_ROWS 0, 1, 2), through WARPFORGE_ATTN_GLUON_BWD_KEY_ROWS.

    PYTHONPATH=. python scripts/bench_attention_gluon.py --gqa-window [--json out.json]

--gqa-window: the family bench's GQA 8:1 fwd+bwd case (b4 h32/kv4 s8192 d128 causal) with the Gluon backward's group
split at 1 (one program walks the whole group), 2, 4 and 8 (one query head per program; WARPFORGE_ATTN_GLUON_BWD_GROUP_
SPLIT) against cuDNN, and its sliding-window case (b2 h16 s16384 d128 causal, window (4096, 0)) fwd+bwd with the Gluon
window on and off (WARPFORGE_ATTN_GLUON_WINDOW) against FlexAttention; the same setups (inputs, rotation, FLOPs,
scores against the fp32 reference) as `warpforge bench --family attention`, in one process.
"""
import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402

import warpforge as wf  # noqa: E402
from warpforge.ops.attention import api, configs  # noqa: E402
from warpforge.ops.attention import flash_gluon_bwd_kernel as fb  # noqa: E402
from warpforge.ops.attention import flash_gluon_kernel as fg  # noqa: E402

CASES = [  # b, h, s, d, causal
    (4, 16, 8192, 128, True),
    (4, 16, 8192, 128, False),
    (32, 16, 1024, 128, True),
    (8, 32, 4096, 64, True),
]
SWEEP = [(128, 2, True, False), (128, 2, False, False), (128, 3, True, False), (64, 4, True, False),
         (128, 2, True, True), (64, 4, True, True)]
SWEEP_D64 = [(128, 4, True, False), (128, 2, True, False), (128, 4, True, True)]


def flops(b, h, s, d, causal):
    return 4 * b * h * s * s * d / (2 if causal else 1)


def input_sets(b, h, s, d, l2_bytes):
    per_set = 3 * b * s * h * d * 2
    n = max(2, math.ceil(2 * l2_bytes / per_set))
    g = torch.Generator(device="cuda").manual_seed(0)
    return [[torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]
            for _ in range(n)]


def timed(fn, sets):
    """Median ms of fn(*set) (fn(set) for a set that is not a list or tuple), each call on the next input set."""
    i = [0]

    def call():
        st = sets[i[0] % len(sets)]
        i[0] += 1
        return fn(*st) if isinstance(st, (list, tuple)) else fn(st)
    return triton.testing.do_bench(call, warmup=10, rep=60, return_mode="median")


def sdpa_cudnn(causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                                 v.transpose(1, 2), is_causal=causal)
        return o.transpose(1, 2)
    return run


def portable(causal):
    def run(q, k, v):
        return wf.flash_attention(q, k, v, causal=causal)
    return run


def gluon(causal, block_n=None, stages=None, pingpong=None, persistent=None):
    def run(q, k, v):
        knobs = api.gluon_knobs(q.shape[-1], causal) if block_n is None else (block_n, stages, pingpong, persistent)
        return fg.flash_fwd_gluon(q, k, v, q.shape[-1] ** -0.5, causal, *knobs)[0]
    return run


def run_case(b, h, s, d, causal, l2, sweep):
    sets = input_sets(b, h, s, d, l2)
    q, k, v = sets[0]
    fl = flops(b, h, s, d, causal)
    paths = {"gluon": gluon(causal), "portable": portable(causal), "cudnn": sdpa_cudnn(causal)}
    if sweep and causal:
        grid = SWEEP_D64 if d == 64 else SWEEP
        for block_n, stages, pp, pers in grid:
            if fg.smem_bytes(d, block_n, stages, pers) <= fg.SMEM_MAX:
                paths[f"gluon bn{block_n} st{stages} pp{int(pp)} pers{int(pers)}"] = gluon(causal, block_n, stages, pp,
                                                                                       pers)
    ref = None
    try:
        ref = paths["cudnn"](q, k, v)
    except Exception as e:  # noqa: BLE001 - a torch build without cuDNN attention: say so, time the rest
        print(f"  cudnn: unavailable ({type(e).__name__}: {str(e)[:120]})")
        paths.pop("cudnn")
    rows = {}
    for name, fn in paths.items():
        t0 = time.perf_counter()
        try:
            out = fn(q, k, v)
            torch.cuda.synchronize()
            err = (out.float() - ref.float()).abs().max().item() if ref is not None else float("nan")
            ms = timed(fn, sets)
        except Exception as e:  # noqa: BLE001 - one failing knob must not stop the rest of the sweep
            print(f"  {name:32s} FAILED: {type(e).__name__}: {str(e)[:200]}")
            continue
        rows[name] = dict(ms=ms, tflops=fl / ms / 1e9, max_err=err, wall_s=time.perf_counter() - t0)
    base = rows.get("cudnn", {}).get("ms")
    label = f"b{b} h{h} s{s} d{d} {'causal' if causal else 'full'}"
    print(f"{label}  ({fl / 1e12:.3f} TFLOP)")
    for name, r in rows.items():
        ratio = f"{base / r['ms']:.3f}x cuDNN" if base else "-"
        r["vs_cudnn"] = base / r["ms"] if base else None
        print(f"  {name:32s} {r['ms']:8.3f} ms {r['tflops']:7.1f} TFLOP/s  {ratio:>14s}  max|err| vs SDPA "
              f"{r['max_err']:.2e}")
    del sets
    torch.cuda.empty_cache()
    return label, rows


# ------------------------------------------------------------------------------------------ forward + backward
BWD_CASES = [  # b, h_q, h_kv, s, d (all causal): the attention bench's fwd+bwd cases
    (4, 16, 16, 8192, 128),
    (32, 16, 16, 1024, 128),
    (1, 16, 16, 32768, 128),
    (8, 32, 32, 4096, 64),
    (4, 32, 4, 8192, 128),
]
BWD_SWEEP = {  # (BLOCK_M, STAGES, DQ_N, DQ_SPLIT, DQ_TMA); the table's default runs as "gluon+gluon"
    # session 11: dQ's reduction is the suspect (per-thread fp32 atomics, 64 KB per tile pair): halve it (split), send
    # it as TMA reduce-adds from shared memory (tma), both (FA3's schedule), the third ring slot that split+tma fits,
    # and tma with one full-width dQ wgmma (dq128)
    128: [(64, 2, 64, 1, 0), (64, 2, 64, 0, 1), (64, 2, 64, 1, 1), (64, 3, 64, 1, 1), (64, 2, 128, 0, 1)],
    64: [(64, 4, 32, 1, 0), (64, 4, 64, 0, 1), (64, 4, 32, 1, 1), (64, 2, 32, 1, 1)],
}
BWD_SWEEP_CASES = ((4, 16, 16, 8192, 128), (32, 16, 16, 1024, 128), (8, 32, 32, 4096, 64))
BWD_KNOB_ENV = ("WARPFORGE_ATTN_GLUON_BWD_BLOCK_M", "WARPFORGE_ATTN_GLUON_BWD_STAGES", "WARPFORGE_ATTN_GLUON_BWD_DQ_N",
                "WARPFORGE_ATTN_GLUON_BWD_DQ_SPLIT", "WARPFORGE_ATTN_GLUON_BWD_DQ_TMA")


def bwd_sets(b, h_q, h_kv, s, d, l2_bytes):
    """Input sets (q, k, v, do and cuDNN's [b, h, s, d] copies, kv expanded for GQA), enough to pass 2x the L2."""
    per_set = (2 * h_q + 2 * h_kv) * b * s * d * 2
    n = max(2, math.ceil(2 * l2_bytes / per_set))
    g = torch.Generator(device="cuda").manual_seed(0)
    sets = []
    for _ in range(n):
        q = torch.randn(b, s, h_q, d, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(b, s, h_kv, d, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(b, s, h_kv, d, device="cuda", dtype=torch.bfloat16, generator=g)
        do = torch.randn(b, s, h_q, d, device="cuda", dtype=torch.bfloat16, generator=g)
        grp = h_q // h_kv
        st = dict(q=q.requires_grad_(), k=k.requires_grad_(), v=v.requires_grad_(), do=do,
                  qt=q.detach().transpose(1, 2).contiguous().requires_grad_(),
                  kt=k.detach().transpose(1, 2).repeat_interleave(grp, 1).contiguous().requires_grad_(),
                  vt=v.detach().transpose(1, 2).repeat_interleave(grp, 1).contiguous().requires_grad_(),
                  dot=do.transpose(1, 2).contiguous())
        sets.append(st)
    return sets


KEY_ROWS_ENV = "WARPFORGE_ATTN_GLUON_BWD_KEY_ROWS"


def warpforge_fwd_bwd(gluon_bwd, knobs=None, key_rows=None):
    """The public call, forward + backward; the Gluon forward on, the Gluon backward on or off (env, read per call);
    key_rows None: the table's, else the backward's transposed step (0 off, 1, 2)."""
    def run(st):
        os.environ[configs.GLUON_ENV] = "1"
        os.environ[configs.GLUON_BWD_ENV] = "1" if gluon_bwd else "0"
        for name, value in zip(BWD_KNOB_ENV, knobs or ()):
            os.environ[name] = str(value)
        if key_rows is not None:
            os.environ[KEY_ROWS_ENV] = str(key_rows)
        try:
            out = wf.flash_attention(st["q"], st["k"], st["v"], causal=True)
            return torch.autograd.grad(out, (st["q"], st["k"], st["v"]), st["do"])
        finally:
            for name in BWD_KNOB_ENV + (KEY_ROWS_ENV, ):
                os.environ.pop(name, None)
    return run


def gluon_fwd_only(st):
    with torch.no_grad():
        return (gluon(True)(st["q"], st["k"], st["v"]), )


def cudnn_fwd_bwd(st):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(st["qt"], st["kt"], st["vt"], is_causal=True)
    return torch.autograd.grad(out, (st["qt"], st["kt"], st["vt"]), st["dot"])


def cudnn_grads_bshd(grads, h_kv):
    """cuDNN's [b, h, s, d] gradients in [b, s, h, d]; GQA: the expanded copies' dk, dv summed over each group (for
    the error check only, outside the timing, as the main bench leaves them)."""
    dq, dk, dv = grads
    b, h_q, s, d = dq.shape
    dk = dk.view(b, h_kv, h_q // h_kv, s, d).sum(2)
    dv = dv.view(b, h_kv, h_q // h_kv, s, d).sum(2)
    return tuple(t.transpose(1, 2) for t in (dq, dk, dv))


def run_bwd_case(b, h_q, h_kv, s, d, l2, sweep, key_rows_variants=False):
    sets = bwd_sets(b, h_q, h_kv, s, d, l2)
    fl = flops(b, h_q, s, d, True)
    paths = {"gluon+gluon": warpforge_fwd_bwd(True), "gluon+portable": warpforge_fwd_bwd(False),
             "cudnn": cudnn_fwd_bwd, "gluon fwd": gluon_fwd_only}
    if key_rows_variants:  # the backward's transposed step off, 1 and 2, beside the table's (where the knobs take it)
        for value in (0, 1, 2):
            paths[f"gluon+gluon key_rows {value}"] = warpforge_fwd_bwd(True, key_rows=value)
    if sweep and (b, h_q, h_kv, s, d) in BWD_SWEEP_CASES:
        for knobs in BWD_SWEEP[d]:
            bm, st, dq_n, split, tma = knobs
            if fb.smem_bytes(d, bm, st, d // 2 if split else dq_n, bool(split), bool(tma)) <= fg.SMEM_MAX:
                paths["gluon+gluon bm{} st{} dq{} split{} tma{}".format(*knobs)] = warpforge_fwd_bwd(True, knobs)
    launches = []
    real = fb.flash_bwd_gluon

    def spy(*args, **kwargs):
        launches.append(args[8:])
        return real(*args, **kwargs)
    fb.flash_bwd_gluon = spy
    ref = None
    try:
        ref = cudnn_grads_bshd(cudnn_fwd_bwd(sets[0]), h_kv)
    except Exception as e:  # noqa: BLE001 - a torch build without cuDNN attention: say so, time the rest
        print(f"  cudnn: unavailable ({type(e).__name__}: {str(e)[:120]})")
        paths.pop("cudnn")
    rows = {}
    try:
        for name, fn in paths.items():
            t0 = time.perf_counter()
            try:
                del launches[:]
                got = fn(sets[0])
                if name == "cudnn":
                    got = cudnn_grads_bshd(got, h_kv)
                torch.cuda.synchronize()
                ran_gluon_bwd = bool(launches)
                err = float("nan")
                if ref is not None and len(got) == 3:
                    err = max(((g.float() - r.float()).norm() / r.float().norm()).item() for g, r in zip(got, ref))
                ms = timed(fn, sets)
            except Exception as e:  # noqa: BLE001 - one failing path must not stop the rest
                print(f"  {name:40s} FAILED: {type(e).__name__}: {str(e)[:300]}")
                continue
            rows[name] = dict(ms=ms, tflops=(fl if name == "gluon fwd" else 3.5 * fl) / ms / 1e9, max_rel_l2=err,
                              gluon_bwd=ran_gluon_bwd, wall_s=time.perf_counter() - t0)
    finally:
        fb.flash_bwd_gluon = real
    base = rows.get("cudnn", {}).get("ms")
    label = f"fwd+bwd b{b} h{h_q}" + (f"/kv{h_kv}" if h_kv != h_q else "") + f" s{s} d{d} causal"
    print(f"{label}  ({3.5 * fl / 1e12:.3f} TFLOP fwd+bwd)")
    fwd_ms = rows.get("gluon fwd", {}).get("ms")
    for name, r in rows.items():
        ratio = f"{base / r['ms']:.3f}x cuDNN" if base and name != "gluon fwd" else "-"
        r["vs_cudnn"] = base / r["ms"] if base and name != "gluon fwd" else None
        bwd = ""
        if fwd_ms and name.startswith("gluon+"):
            r["bwd_ms"] = r["ms"] - fwd_ms
            bwd = f"  bwd ~{r['bwd_ms']:.3f} ms ({2.5 * fl / r['bwd_ms'] / 1e9:.0f} TFLOP/s)"
        print(f"  {name:40s} {r['ms']:8.3f} ms {r['tflops']:7.1f} TFLOP/s  {ratio:>14s}  rel L2 vs cuDNN "
              f"{r['max_rel_l2']:.2e}  gluon bwd ran: {r['gluon_bwd']}{bwd}")
    del sets
    torch.cuda.empty_cache()
    return label, rows


def run_gqa_window(json_path):
    """GQA group-split variants vs cuDNN, and the window case with the Gluon window on / off vs Flex (one process)."""
    from warpforge.bench.attention_cases import attention_setup
    dev = torch.device("cuda")
    os.environ[configs.GLUON_ENV] = "1"
    os.environ[configs.GLUON_BWD_ENV] = "1"
    t0 = time.perf_counter()
    results = {}
    plans = [
        ("fwd+bwd b4 h32/kv4 s8192 d128 causal (GQA 8:1)", dict(b=4, s=8192, h_q=32, h_kv=4, d=128, causal=True),
         [("cudnn", "cudnn", {})] + [(f"warpforge group_split {g}", "warpforge",
                                      {"WARPFORGE_ATTN_GLUON_BWD_GROUP_SPLIT": str(g)}) for g in (1, 8, 4, 2)],
         "cudnn"),
        ("fwd+bwd b2 h16 s16384 d128 window 4096", dict(b=2, s=16384, h_q=16, h_kv=16, d=128, causal=True,
                                                          window=(4096, 0)),
         [("flex", "flex", {}), ("warpforge gluon window", "warpforge", {configs.GLUON_WINDOW_ENV: "1"}),
          ("warpforge portable window", "warpforge", {configs.GLUON_WINDOW_ENV: "0"})], "flex"),
    ]
    for label, shape, paths, base_name in plans:
        setup = attention_setup(dev, False, backward=True, **shape)
        rows = {}
        print(f"{label}  ({setup.flops / 1e12:.3f} TFLOP)", flush=True)
        for name, impl, env in paths:
            fn = setup.impls.get(impl)
            if fn is None:
                print(f"  {name}: unavailable")
                continue
            old = {key: os.environ.get(key) for key in env}
            os.environ.update(env)
            t1 = time.perf_counter()
            try:
                setup.reset()  # the scored call runs on input set 0, the reference's
                err = setup.score(fn())
                torch.cuda.synchronize()
                ms = triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")
            except Exception as e:  # noqa: BLE001 - one failing path must not stop the rest
                print(f"  {name:32s} FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            finally:
                for key, value in old.items():
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value
            rows[name] = dict(ms=ms, tflops=setup.flops / ms / 1e9, rel_l2=err, wall_s=time.perf_counter() - t1)
        base = rows.get(base_name, {}).get("ms")
        for name, r in rows.items():
            r["vs_" + base_name] = base / r["ms"] if base else None
            ratio = f"{base / r['ms']:.3f}x {base_name}" if base else "-"
            print(f"  {name:32s} {r['ms']:8.3f} ms {r['tflops']:7.1f} TFLOP/s  {ratio:>14s}  rel L2 {r['rel_l2']:.2e}"
                  f"  ({r['wall_s']:.0f} s)", flush=True)
        results[label] = rows
        del setup
        torch.cuda.empty_cache()
        print(f"  ({time.perf_counter() - t0:.1f} s so far)", flush=True)
        if json_path:
            with open(json_path, "w") as f:
                json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                               results=results), f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="also time the Gluon kernel's knobs")
    ap.add_argument("--sweep-only", action="store_true", help="only the sweep's shapes (headline, b32 s1024, d64)")
    ap.add_argument("--bwd", action="store_true", help="forward+backward: Gluon bwd vs portable bwd vs cuDNN")
    ap.add_argument("--bwd-sweep", action="store_true", help="with --bwd: also the Gluon backward's knobs")
    ap.add_argument("--key-rows", action="store_true", help="with --bwd: the backward's KEY_ROWS step 0 / 1 / 2")
    ap.add_argument("--bwd-cases", default=None, help="with --bwd: indices into BWD_CASES, e.g. 0,1,3 (default all)")
    ap.add_argument("--gqa-window", action="store_true", help="GQA group-split variants and the window case")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    assert torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0), "needs an sm_90 GPU"
    assert fg.available(), f"the Gluon kernel needs Triton {fg.GLUON_TRITON_VERSIONS} (have {triton.__version__})"
    if args.gqa_window:
        return run_gqa_window(args.json)
    os.environ[configs.GLUON_ENV] = "0"  # "portable" is the portable kernel; the Gluon kernel is called directly
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 * 2 ** 20) or 50 * 2 ** 20
    print(f"{props.name}, torch {torch.__version__}, triton {triton.__version__}, L2 {l2 / 2 ** 20:.0f} MB; "
          f"default knobs (BLOCK_N, stages, ping-pong): {configs.GLUON_FWD}")
    t0 = time.perf_counter()
    results = {}
    if args.bwd:
        assert fb.available(), f"the Gluon backward needs Triton {fb.GLUON_TRITON_VERSIONS} (have {triton.__version__})"
        print(f"backward knobs (BLOCK_M, STAGES, DQ_N, DQ_SPLIT, DQ_TMA): {configs.GLUON_BWD}; KEY_ROWS "
              f"{configs.GLUON_BWD_KEY_ROWS} where they take it")
        picked = [int(x) for x in args.bwd_cases.split(",")] if args.bwd_cases else range(len(BWD_CASES))
        for case in [BWD_CASES[i] for i in picked]:
            label, rows = run_bwd_case(*case, l2, args.bwd_sweep, args.key_rows)
            results[label] = rows
            print(f"  ({time.perf_counter() - t0:.1f} s so far)", flush=True)
            if args.json:  # after every case: a call that runs out of time keeps what it measured
                with open(args.json, "w") as f:
                    json.dump(dict(gpu=props.name, torch=torch.__version__, triton=triton.__version__,
                                   knobs={str(k): v for k, v in configs.GLUON_BWD.items()}, results=results), f,
                              indent=1)
        print(f"total {time.perf_counter() - t0:.1f} s")
        return
    cases = CASES if not args.sweep_only else [c for c in CASES if c[-1]]
    for case in cases:
        label, rows = run_case(*case, l2, args.sweep or args.sweep_only)
        results[label] = rows
    print(f"total {time.perf_counter() - t0:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=props.name, torch=torch.__version__, triton=triton.__version__, results=results), f,
                      indent=1)


if __name__ == "__main__":
    main()
