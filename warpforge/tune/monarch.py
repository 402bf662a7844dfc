"""Sweep the Monarch kernels' tiles on this GPU at the bench's shape (d 4096 square, 16k tokens, bf16, nblocks 4
and 16): the block-diagonal GEMM's tiles (timed as the forward's two launches), then the weight-gradient tiles
(timed as the backward), then, with both winners, each launch of the step alone, with pointer and descriptor
stores, mode 2 and mode 3, beside cuBLAS on the same GEMMs and on the dense layer. The sweep keeps the table's
descriptor stores and runs, so it times the path the table ships.

    warpforge tune monarch [--nblocks 4,16] [--out tune_monarch.json] [--parts-only]

Winners go into warpforge/ops/monarch/configs.py's MONARCH table, the numbers into benchmarks/NOTES.md.
"""
import argparse

import torch

from warpforge.bench.report import write_json
from warpforge.ops.monarch import configs, monarch_kernel as mk
from warpforge.tune.timing import time_candidate

G, W = configs.GemmCfg, configs.WgradCfg
# (block_m, block_n, block_k, warps, stages, tma, programs_per_sm)
GEMMS = [G(128, 128, 64, 8, 3, True, 1), G(128, 128, 64, 8, 4, True, 1), G(128, 256, 64, 8, 3, True, 1),
         G(256, 128, 64, 8, 3, True, 1), G(128, 128, 64, 4, 3, True, 1), G(64, 128, 64, 4, 4, True, 2),
         G(128, 64, 64, 4, 4, True, 2), G(128, 128, 32, 8, 5, True, 1), G(128, 128, 64, 8, 3, False, 1),
         G(128, 128, 64, 8, 3, False, 2), G(128, 128, 64, 4, 3, False, 2)]
# (block_n, block_k, block_t, warps, stages, splits, tma)
WGRADS = [W(128, 128, 64, 8, 3, 0, True), W(128, 128, 64, 8, 4, 0, True), W(128, 128, 128, 8, 2, 0, True),
          W(128, 256, 64, 8, 3, 0, True), W(64, 128, 64, 4, 4, 0, True), W(128, 128, 64, 4, 3, 0, True),
          W(128, 128, 64, 8, 3, 0, False)]


def main(argv=None):
    ap = argparse.ArgumentParser(prog="warpforge tune monarch")
    ap.add_argument("--nblocks", default="4,16")
    ap.add_argument("--out", default=None)
    ap.add_argument("--parts-only", action="store_true", help="no sweep: each launch alone at the table's tiles")
    args = ap.parse_args(argv)
    t, d = 16 * 1024, 4096
    results = []
    base = configs.MONARCH.lookup(torch.device("cuda"), "any")
    for nb in (int(v) for v in args.nblocks.split(",")):
        gen = torch.Generator(device="cuda").manual_seed(nb)
        x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        dy = torch.randn(t, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        w_right, w_left = ((torch.randn(nb, d // nb, d // nb, device="cuda", generator=gen) * (nb / d) ** 0.5)
                           .to(torch.bfloat16) for _ in range(2))
        flops = 2.0 * t * 2 * d * d / nb
        best_g, best_ms = base.gemm, None
        for g in ([] if args.parts_only else GEMMS):
            g = g._replace(tma_store=base.gemm.tma_store)
            cfg = base._replace(gemm=g)
            ms = time_candidate(lambda: mk.monarch_fwd(x, w_left, w_right, None, cfg))
            if ms is None:
                continue
            results.append(dict(nb=nb, part="fwd", cfg=list(g), ms=ms, tflops=flops / ms / 1e9))
            print(f"nb {nb} fwd {tuple(g)}: {ms:.4f} ms {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
            if best_ms is None or ms < best_ms:
                best_g, best_ms = g, ms
        inter = mk.monarch_fwd(x, w_left, w_right, None, base._replace(gemm=best_g))[1]
        best_w, best_ms = base.wgrad, None
        for w in ([] if args.parts_only else WGRADS):
            cfg = base._replace(gemm=best_g, wgrad=w)
            ms = time_candidate(lambda: mk.monarch_bwd(dy, x, w_left, w_right, inter, False, cfg))
            if ms is None:
                continue
            results.append(dict(nb=nb, part="bwd", cfg=list(w), gemm=list(best_g), ms=ms,
                                tflops=2 * flops / ms / 1e9))
            print(f"nb {nb} bwd {tuple(w)} (gemm {tuple(best_g)}): {ms:.4f} ms {2 * flops / ms / 1e9:.0f} TFLOP/s",
                  flush=True)
            if best_ms is None or ms < best_ms:
                best_w, best_ms = w, ms
        # each launch of the step alone, with the winners, and again with descriptor stores; R's GEMMs in mode 2 and
        # run by run (mode 3)
        g, w = best_g, best_w
        q = p = s = d // nb
        dyb = mk.shuffle(dy, nb, base, to_blocks=True)
        dh = torch.empty_like(x)
        out = torch.empty_like(x)
        dwl, dwr = torch.empty_like(w_left), torch.empty_like(w_right)
        w_r = mk.runs_first(w_right)
        gemms = {"": g._replace(tma_store=False), " +store": g._replace(tma_store=True)}
        parts = {"P_out (y's shuffle)": lambda: mk.shuffle(out, nb, base, to_blocks=False),
                 "P_out^T (dy's shuffle)": lambda: mk.shuffle(dy, nb, base, to_blocks=True),
                 "runs_first (w_right's rows renumbered)": lambda: mk.runs_first(w_right)}
        for tag, gg in gemms.items():
            parts.update({
                f"R (x -> g, mode 2 stores){tag}": lambda gg=gg: mk._gemm(
                    x, w_right, (w_right.stride(2), w_right.stride(1)), out, p, q, nb, mk.CONTIGUOUS, p, mk.SHUFFLING,
                    q, gg),
                f"R (x -> g, mode 3){tag}": lambda gg=gg: mk._gemm(
                    x, w_r, (w_r.stride(2), w_r.stride(1)), out, p, q, nb, mk.CONTIGUOUS, p, mk.RUNS_FIRST, q, gg),
                f"L (g -> y in block order){tag}": lambda gg=gg: mk._gemm(
                    inter, w_left, (w_left.stride(2), w_left.stride(1)), out, q, s, nb, mk.CONTIGUOUS, q,
                    mk.CONTIGUOUS, s, gg),
                f"Lt (dy -> dh in block order){tag}": lambda gg=gg: mk._gemm(
                    dyb, w_left, (w_left.stride(1), w_left.stride(2)), dh, s, q, nb, mk.CONTIGUOUS, s, mk.CONTIGUOUS,
                    q, gg),
                f"Rt (dh -> dx){tag}": lambda gg=gg: mk._gemm(
                    dh, w_right, (w_right.stride(1), w_right.stride(2)), out, q, p, nb, mk.CONTIGUOUS, q,
                    mk.CONTIGUOUS, p, gg),
                f"Rt (dhb -> dx, mode 3){tag}": lambda gg=gg: mk._gemm(
                    dh, w_r, (w_r.stride(1), w_r.stride(2)), out, q, p, nb, mk.RUNS_FIRST, q, mk.CONTIGUOUS, p, gg)})
        # cuBLAS on the same block-diagonal GEMM (x's blocks as a strided batch, no copy, and copied contiguous) and
        # on the dense layer the bench compares against: what these shapes allow a vendor GEMM, same process
        xb = x.view(t, nb, p).transpose(0, 1)
        xbc, w_t, w_dense = xb.contiguous(), w_right.transpose(1, 2), torch.randn(d, d, device="cuda",
                                                                                   dtype=torch.bfloat16)
        b_out = torch.empty(nb, t, q, device="cuda", dtype=torch.bfloat16)
        parts.update({
            "cuBLAS bmm (R's GEMM, x's blocks strided)": lambda: torch.bmm(xb, w_t, out=b_out),
            "cuBLAS bmm (R's GEMM, blocks contiguous)": lambda: torch.bmm(xbc, w_t, out=b_out),
            "cuBLAS dense (x @ W^T, d x d)": lambda: torch.nn.functional.linear(x, w_dense),
            # the other steps as cuBLAS could run them on these layouts, no copies: L (g's blocks into yb's), the
            # weight gradients (the table's wgrad_blas), R run by run (nb calls, each writing its run of every block)
            "cuBLAS bmm (L's GEMM, g's blocks into yb's)": lambda: torch.bmm(
                inter.view(t, nb, q).transpose(0, 1), w_left.transpose(1, 2), out=out.view(t, nb, s).transpose(0, 1)),
            "cuBLAS dR (wgrad_blas: mode 2 one bmm)": lambda: mk._wgrad_blas(dh, x, dwr, nb, mk.CONTIGUOUS),
            "cuBLAS dR (wgrad_blas: mode 3, a bmm per l)": lambda: mk._wgrad_blas(dh, x, dwr, nb, mk.RUNS_FIRST),
            "cuBLAS dL (wgrad_blas)": lambda: mk._wgrad_blas(dyb, inter, dwl, nb, mk.CONTIGUOUS),
            "cuBLAS bmm x nb (R run by run, into g)": lambda: [torch.bmm(
                xb, w_r[:, l * (q // nb):(l + 1) * (q // nb)].transpose(1, 2),
                out=out.view(t, nb, nb, q // nb)[:, l].transpose(0, 1)) for l in range(nb)]})
        parts.update({
            "dL": lambda: mk._wgrad(dyb, inter, dwl, s, q, nb, mk.CONTIGUOUS, s, mk.CONTIGUOUS, q, w),
            "dR": lambda: mk._wgrad(dh, x, dwr, q, p, nb, mk.CONTIGUOUS, q, mk.CONTIGUOUS, p, w),
            "dR (dhb, mode 3)": lambda: mk._wgrad(dh, x, dwr, q, p, nb, mk.RUNS_FIRST, q, mk.CONTIGUOUS, p, w)})
        for name, fn in parts.items():
            ms = time_candidate(fn)
            if ms is not None:
                results.append(dict(nb=nb, part=name, gemm=list(g), wgrad=list(w), ms=ms))
                print(f"nb {nb} {name}: {ms:.4f} ms", flush=True)
        print(f"nb {nb} winners: gemm {tuple(best_g)} wgrad {tuple(best_w)}", flush=True)
        x = dy = inter = dyb = dh = out = xb = xbc = b_out = None  # freed before the next nblocks
        torch.cuda.empty_cache()
    if args.out:
        write_json(results, args.out)


if __name__ == "__main__":
    main()
