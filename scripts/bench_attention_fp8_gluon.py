"""FP8 attention forward on an H200: the Hopper Gluon FP8 kernel (ops/attention/fp8_gluon_kernel.py) with its
quantiser, timed together and apart, beside cuDNN SDPA bf16 and warpforge's bf16 Gluon forward, in one process on
the same data.

    PYTHONPATH=. python scripts/bench_attention_fp8_gluon.py [--sweep] [--quick] [--json out.json]

Per case (bf16 inputs): ms (triton.testing.do_bench median; each call takes the next of a rotation of input sets
that together pass 2x the L2), TFLOP/s (4 · b · h · s² · d, halved when causal) and the ratio to cuDNN, for
  cudnn bf16            SDPA through SDPBackend.CUDNN_ATTENTION on [b, h, s, d] views
  gluon bf16            flash_gluon_kernel.flash_fwd_gluon (the bf16 Gluon forward), its table's knobs
  fp8 all-in / int8 all-in   flash_attention_fp8 (quantize_qkv + the Gluon FP8 kernel), the bar's measure
  fp8 kernel / int8 kernel   the Gluon FP8 kernel alone on pre-quantised inputs
  quantise fp8 / int8   the quantiser alone as flash_attention_fp8 runs it (int8 without return_lse: no lse shift),
                        with GB/s against its bytes on paper (bf16 q, k, v read, v read twice: its channel amax and
                        its codes, int8's k once more for its mean; 1-byte codes and fp32 scales written) and the copy
                        rate; "quantise int8 + lse shift" is quantize_qkv's int8 (what return_lse adds)
  portable fp8 all-in   the portable FP8 kernel (fp8_kernel.py) with the same quantiser (first case only)
and the cosine of each FP8 output against fp32 attention on the unquantised inputs (two heads, exact).
  fp8 / int8 kernel permute_k, all-in permute_k   the same with WARPFORGE_ATTN_FP8_GLUON_PERMUTE_K's schedule (K's
                        rows permuted within 16-key groups, P into the P·V operand without data movement; K laid out
                        [b, h, s_pad, d] by the quantiser)
--sweep: the FP8 kernel's knobs (BLOCK_N, stages, ping-pong, persistent) at the headline shape.
"""
import argparse
import dataclasses
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402

import warpforge as wf  # noqa: E402
from warpforge.ops.attention import api, fp8_api, quantize_qkv  # noqa: E402
from warpforge.ops.attention import flash_gluon_kernel as fg  # noqa: E402
from warpforge.ops.attention import fp8_gluon_kernel as fk  # noqa: E402
from warpforge.ops.attention.reference import attention_reference  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention_gluon import flops, input_sets, sdpa_cudnn, timed  # noqa: E402

CASES = [  # b, h, s, d, causal
    (4, 16, 8192, 128, True),
    (4, 16, 8192, 128, False),
    (8, 32, 4096, 64, True),
]
SWEEP = [(128, 2, True, False), (128, 3, True, False), (128, 4, True, False), (128, 3, False, False),
         (64, 4, True, False), (128, 3, True, True), (128, 2, True, True)]  # + each of the first two with PERMUTE_K


def quantiser_bytes(b, h, s, d, qk_format):
    """Bytes on paper: q, k, v read (bf16) and v read a second time (amax, then codes); codes (1 B) and fp32 scales
    written. int8 also reads k for its mean (the lse shift's pass over q, when lse is returned, is not counted)."""
    n = b * s * h * d
    read = 4 * n * 2 + (n * 2 if qk_format == "int8" else 0)
    write = 3 * n + 4 * (2 * b * s * h + b * h * d)
    return read + write


def copy_rate(l2):
    """Device-to-device copy GB/s (read + write) of a buffer 4x the L2."""
    n = int(8 * l2) // 4
    a = torch.empty(n, device="cuda", dtype=torch.float32)
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=5, rep=30, return_mode="median")
    return 2 * a.numel() * 4 / ms / 1e6


def exact_cos(out, q, k, v, causal, heads=2):
    """Cosine of out against fp32 attention on the unquantised inputs, over the first batch's first heads."""
    num = den_a = den_b = 0.0
    for h in range(heads):
        sl = (slice(0, 1), slice(None), slice(h, h + 1))
        ref, _ = attention_reference(q[sl].float(), k[sl].float(), v[sl].float(), causal=causal)
        a, b = out[sl].double().flatten(), ref.double().flatten()
        num += (a @ b).item()
        den_a += (a @ a).item()
        den_b += (b @ b).item()
    return num / math.sqrt(den_a * den_b)


def run_case(b, h, s, d, causal, l2, copy_gbs, sweep, portable):
    sets = input_sets(b, h, s, d, l2)
    q, k, v = sets[0]
    fl = flops(b, h, s, d, causal)
    scale = d ** -0.5
    rows, notes = {}, {}

    def add(name, fn, data, fl_=fl, bytes_=None, ref_out=None):
        t0 = time.perf_counter()
        try:
            out = fn(*data[0]) if isinstance(data[0], (list, tuple)) else fn(data[0])
            torch.cuda.synchronize()
            ms = timed(fn, data)
        except Exception as e:  # noqa: BLE001 - one failing path must not stop the rest
            print(f"  {name:34s} FAILED: {type(e).__name__}: {str(e)[:300]}")
            return None
        r = dict(ms=ms, wall_s=time.perf_counter() - t0)
        if fl_:
            r["tflops"] = fl_ / ms / 1e9
        if bytes_:
            r["gbs"] = bytes_ / ms / 1e6
            r["of_copy"] = r["gbs"] / copy_gbs
        rows[name] = r
        return out

    os.environ[api.configs.GLUON_ENV] = "1"
    add("cudnn bf16", sdpa_cudnn(causal), sets)
    add("gluon bf16", lambda q, k, v: fg.flash_fwd_gluon(q, k, v, scale, causal, *api.gluon_knobs(d, causal))[0],
        sets)
    for fmt in ("fp8", "int8"):
        os.environ[fp8_api.FP8_GLUON_ENV] = "1"
        qsets = [quantize_qkv(*x, qk_format=fmt) for x in sets]
        # what flash_attention_fp8 runs without return_lse (int8: no lse shift)
        add(f"quantise {fmt}", lambda q, k, v, f=fmt: fp8_api._quantize(q, k, v, f, None, False), sets, fl_=0,
            bytes_=quantiser_bytes(b, h, s, d, fmt))
        if fmt == "fp8" and portable:  # the quantiser's parts, to see which one is off the copy rate
            from warpforge.ops.attention.fp8_quantize import padded_tokens, v_channel_scale
            from warpforge.ops.attention.fp8_quantize_kernel import quantize_rows, quantize_v
            n = b * s * h * d
            add("  part: q rows (codes + scales)", lambda q, k, v: quantize_rows(q, None, "fp8"), sets, fl_=0,
                bytes_=3 * n + 4 * b * s * h)
            add("  part: v channel amax (torch)", lambda q, k, v: v_channel_scale(v), sets, fl_=0, bytes_=2 * n)
            vsc = v_channel_scale(q)
            add("  part: v codes, channel-major", lambda q, k, v: quantize_v(v, vsc, padded_tokens(s)), sets, fl_=0,
                bytes_=3 * n)
            add("  part: k scales by head (kernel)", lambda x: fk.key_scales_by_head(x.k_scale), qsets, fl_=0,
                bytes_=8 * b * s * h)
        if fmt == "int8":  # quantize_qkv: with the lse shift q · mean(k) (torch, fp32 copy of q)
            add("quantise int8 + lse shift", lambda q, k, v: quantize_qkv(q, k, v, qk_format="int8"), sets, fl_=0)
        knobs = fp8_api.fp8_gluon_knobs(d, causal)
        add(f"{fmt} kernel", lambda x: fk.flash_fp8_fwd_gluon(x, scale, causal, *knobs)[0], qsets)
        # PERMUTE_K: K's rows permuted so that P needs no data movement; K pre-laid-out by head (as the quantiser
        # writes it for flash_attention_fp8 when the knob is on), so this is the kernel alone
        psets = [(x, fk.keys_by_head(x.k)[0].transpose(1, 2)[:, :x.k.shape[1]]) for x in qsets]
        psets = [dataclasses.replace(x, k=kb) for x, kb in psets]
        add(f"{fmt} kernel permute_k", lambda x: fk.flash_fp8_fwd_gluon(x, scale, causal, *knobs, permute_k=True)[0],
            psets)
        os.environ[fp8_api.FP8_GLUON_ENV + "_PERMUTE_K"] = "1"
        add(f"{fmt} all-in permute_k", lambda q, k, v, f=fmt: wf.flash_attention_fp8(q, k, v, causal=causal,
                                                                                    qk_format=f), sets)
        os.environ[fp8_api.FP8_GLUON_ENV + "_PERMUTE_K"] = "0"
        del psets
        out = add(f"{fmt} all-in", lambda q, k, v, f=fmt: wf.flash_attention_fp8(q, k, v, causal=causal, qk_format=f),
                  sets)
        if out is not None:
            notes[f"{fmt} 1-cos"] = 1 - exact_cos(out, q, k, v, causal)
        if sweep:
            for block_n, stages, pp, pers in SWEEP:
                if fk.smem_bytes(d, block_n, stages, pers) <= fk.SMEM_MAX:
                    add(f"{fmt} kernel bn{block_n} st{stages} pp{int(pp)} pers{int(pers)}",
                        lambda x, kn=(block_n, stages, pp, pers): fk.flash_fp8_fwd_gluon(x, scale, causal, *kn)[0],
                        qsets)
            for block_n, stages, pp, pers in SWEEP[:2]:
                add(f"{fmt} kernel bn{block_n} st{stages} permute_k (K copied)",
                    lambda x, kn=(block_n, stages, pp, pers): fk.flash_fp8_fwd_gluon(x, scale, causal, *kn,
                                                                                       permute_k=True)[0], qsets)
        if portable and fmt == "fp8":
            os.environ[fp8_api.FP8_GLUON_ENV] = "0"
            out = add("portable fp8 all-in", lambda q, k, v: wf.flash_attention_fp8(q, k, v, causal=causal), sets)
            if out is not None:
                notes["portable fp8 1-cos"] = 1 - exact_cos(out, q, k, v, causal)
            os.environ[fp8_api.FP8_GLUON_ENV] = "1"
        del qsets
    base = rows.get("cudnn bf16", {}).get("ms")
    label = f"b{b} h{h} s{s} d{d} {'causal' if causal else 'full'}"
    print(f"{label}  ({fl / 1e12:.3f} TFLOP)")
    for name, r in rows.items():
        r["vs_cudnn"] = base / r["ms"] if base else None
        extra = (f"{r['tflops']:7.1f} TFLOP/s" if "tflops" in r else
                 f"{r['gbs']:7.0f} GB/s ({r['of_copy']:.0%} of copy)" if "gbs" in r else "")
        ratio = f"{base / r['ms']:.3f}x cuDNN" if base and "tflops" in r else ""
        print(f"  {name:34s} {r['ms']:8.3f} ms {extra}  {ratio}")
    for name, val in notes.items():
        print(f"  {name:34s} {val:.2e}")
    del sets
    torch.cuda.empty_cache()
    return label, dict(rows=rows, notes=notes)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="also time the FP8 kernel's knobs (headline shape)")
    ap.add_argument("--quick", action="store_true", help="the headline shape only")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    assert torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0), "needs an sm_90 GPU"
    assert fk.available(), f"the Gluon FP8 kernel needs Triton {fk.GLUON_TRITON_VERSIONS} (have {triton.__version__})"
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 * 2 ** 20) or 50 * 2 ** 20
    copy_gbs = copy_rate(l2)
    print(f"{props.name}, torch {torch.__version__}, triton {triton.__version__}, L2 {l2 / 2 ** 20:.0f} MB, copy "
          f"{copy_gbs:.0f} GB/s; FP8 knobs (BLOCK_N, stages, ping-pong, persistent): {fp8_api.FP8_GLUON_FWD}")
    t0 = time.perf_counter()
    results = {}
    cases = CASES[:1] if args.quick else CASES
    with torch.no_grad():
        for i, case in enumerate(cases):
            label, res = run_case(*case, l2, copy_gbs, args.sweep and i == 0, portable=i == 0)
            results[label] = res
    print(f"total {time.perf_counter() - t0:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=props.name, torch=torch.__version__, triton=triton.__version__, copy_gbs=copy_gbs,
                           results=results), f, indent=1)


if __name__ == "__main__":
    main()
