"""Sweep the Evoformer kernels' tiles on this GPU at the bench's shapes (row attention N_seq 512, N_res 384, 8 heads
of 32, a mask and a pair bias; the extra-MSA stack's 5120 rows of 8 heads of 8), bf16, each pass timed alone: the
forward, the one-walk dk/dv/dq backward (configs.bwd_fused), the dk/dv pass (also with its step transposed, keys as
rows), the dq pass and the pair-bias gradient; register-capped tiles too (EvoCfg.maxnreg).

    warpforge tune evoformer [--shapes row,extra] [--parts fwd,fused,dkdv,dq,dbias] [--out tune_evoformer.json]

Winners go into warpforge/ops/evoformer/configs.py's TILES table, the numbers into benchmarks/NOTES.md.
"""
import argparse
import math

import torch

from warpforge.bench.report import write_json
from warpforge.ops.evoformer import configs, evoformer_kernel as ek
from warpforge.tune.timing import time_candidate

C = configs.EvoCfg
CANDIDATES = [C(64, 64, 4, 2), C(64, 64, 4, 3), C(128, 64, 4, 3), C(128, 64, 8, 3), C(128, 64, 8, 2),
              C(128, 128, 8, 2), C(64, 128, 4, 2), C(32, 64, 4, 3), C(64, 32, 4, 3), C(128, 32, 4, 3), C(32, 32, 4, 2),
              C(64, 64, 2, 2), C(32, 64, 2, 2), C(64, 32, 2, 3), C(128, 128, 8, 3), C(64, 128, 8, 2)]
# the dk/dv pass's step with keys as rows (EvoCfg.key_rows; the other passes ignore it)
KEY_ROWS = [C(64, 64, 4, 3, True), C(64, 64, 4, 2, True), C(64, 128, 4, 2, True), C(64, 128, 8, 2, True),
            C(128, 64, 8, 2, True), C(32, 64, 4, 3, True), C(64, 32, 4, 3, True), C(64, 64, 2, 2, True),
            C(32, 64, 4, 3, True, 112), C(32, 64, 4, 3, True, 102), C(64, 64, 4, 3, True, 128)]
# register caps (EvoCfg.maxnreg: more programs an SM), for the forward, the dq pass and the pair-bias pass
CAPPED = [C(128, 32, 4, 3, maxnreg=128), C(128, 32, 4, 3, maxnreg=120), C(128, 64, 4, 3, maxnreg=128),
          C(64, 64, 4, 3, maxnreg=112), C(64, 32, 4, 3, maxnreg=88), C(128, 32, 4, 4, maxnreg=128)]
SHAPES = {"row": dict(S=512, R=384, H=8, D=32), "extra": dict(S=5120, R=384, H=8, D=8)}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="warpforge tune evoformer")
    ap.add_argument("--shapes", default="row,extra", help="of " + ", ".join(SHAPES))
    ap.add_argument("--parts", default="fwd,fused,dkdv,dq,dbias", help="which passes to sweep")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    results = []
    for name in args.shapes.split(","):
        S, R, H, D = (SHAPES[name][key] for key in ("S", "R", "H", "D"))
        gen = torch.Generator(device="cuda").manual_seed(R)

        def rnd(*shape):
            return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)
        q, k, v, do, gate = (rnd(1, S, R, H, D) for _ in range(5))
        mask = torch.zeros(1, S, 1, 1, R, device="cuda", dtype=torch.bfloat16).expand(1, S, H, R, R)
        pair = rnd(1, 1, H, R, R).expand(1, S, H, R, R)
        biases, scale = (mask, pair), 1.0 / math.sqrt(D)
        flops = 4.0 * S * H * R * R * D
        base = configs.TILES.lookup(torch.device("cuda"), ek._block(D))
        out, lse = ek.evoformer_fwd(q, k, v, biases, gate, scale, base.fwd)

        def record(part, cfg, ms, part_flops):
            results.append(dict(shape=name, part=part, cfg=list(cfg), ms=ms, tflops=part_flops / ms / 1e9))
            print(f"{name} {part} {tuple(cfg)}: {ms:.3f} ms {part_flops / ms / 1e9:.0f} TFLOP/s", flush=True)
        for cfg in CANDIDATES + CAPPED if "fwd" in parts else ():
            ms = time_candidate(lambda: ek.evoformer_fwd(q, k, v, biases, gate, scale, cfg))
            if ms is not None:
                record("fwd", cfg, ms, flops)
        # the one-walk dk/dv/dq backward (configs.bwd_fused), the dbias pass at the table's entry
        for cfg in CANDIDATES if "fused" in parts else ():
            tiles = base._replace(fused=cfg)
            ms = time_candidate(lambda: ek.evoformer_bwd(do, q, k, v, out, lse, biases, gate, scale, True, tiles,
                                                         fused=True))
            if ms is not None:
                record("bwd, fused swept", cfg, ms, 2.5 * flops)
        for part in [p for p in ("dkdv", "dq", "dbias") if p in parts]:  # one swept, the others at the table's
            for cfg in CANDIDATES + {"dkdv": KEY_ROWS, "dq": CAPPED, "dbias": CAPPED}.get(part, []):
                tiles = base._replace(**{part: cfg})
                ms = time_candidate(lambda: ek.evoformer_bwd(do, q, k, v, out, lse, biases, gate, scale, True,
                                                                    tiles))
                if ms is not None:
                    record(f"bwd, {part} swept", cfg, ms, 2.5 * flops)
    if args.out:
        write_json({"sweep": "evoformer", "results": results}, args.out)
    return 0
