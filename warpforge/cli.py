"""Command line: `warpforge bench`, `warpforge report`, `warpforge gpt ...`, `warpforge info`."""
from __future__ import annotations

import argparse
import os
import re
import sys


def _prepare_device():
    """Without a GPU, kernels run through the Triton interpreter; it must be on before triton is used."""
    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
        return torch.device("cpu")
    return torch.device("cuda")


def cmd_bench(args) -> int:
    device = _prepare_device()
    from .bench import cases as registry
    from .bench import report, runner

    if args.list:
        for c in registry.select(args.family, args.quick):
            print(f"{c.family:10s} {c.name}{'  (quick)' if c.quick else ''}")
        return 0
    known = registry.families()
    if args.family not in (None, "all") and args.family not in known:
        print(f"warpforge bench: unknown family {args.family!r}; known: {', '.join(known)}", file=sys.stderr)
        return 2
    selected = registry.select(args.family, args.quick)
    if device.type == "cpu":
        print("No GPU found: running every kernel through the Triton interpreter at tiny sizes, "
              "checked against its reference. Times are not GPU times.", flush=True)
    if args.match:
        selected = [c for c in selected if re.search(args.match, c.name)]
    checkpoint = (lambda res: report.write_json(res, args.json)) if args.json else None
    result = runner.run(selected, device, log=lambda s: print(s, flush=True), checkpoint=checkpoint)
    print(report.table(result))
    if args.json:
        report.write_json(result, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        report.plot(result, args.plot)
        print(f"wrote {args.plot}")
    failed = [r for r in result["rows"] if r["impl"] == "warpforge" and r.get("ms") is None]
    return 1 if failed else 0


def cmd_report(args) -> int:
    import json

    from .bench import report
    for path in args.paths:
        with open(path) as f:
            print(f"### {os.path.basename(path)}\n\n```\n{report.table(json.load(f))}\n```\n")
    return 0


def cmd_gpt(args) -> int:
    """`warpforge gpt prepare | train | sample`: errors a user can act on are one line, exit code 2."""
    if args.gpt_cmd == "prepare":
        from .models.gpt.data import prepare
        prepare(args.out)
        return 0
    if args.gpt_cmd == "train":
        from .models.gpt.data import DataMissing
        from .models.gpt.train import TrainError, train
        try:
            result = train(args.preset, args.out, resume=args.resume, max_steps=args.max_steps,
                           max_minutes=args.max_minutes, data=args.data, compile=args.compile,
                           parallel=args.parallel, ddp_bucket_mb=args.ddp_bucket_mb,
                           ddp_bf16_grads=args.ddp_bf16_grads or None)
        except (TrainError, DataMissing) as exc:
            print(f"warpforge gpt train: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            return 130
        vals = [h["val_loss"] for h in result["history"] if "val_loss" in h]
        print(f"done: step {result['step']}" + (f", val {vals[-1]:.3f} nats/byte" if vals else ""))
        return 0
    from .models.gpt.sample import load, sample
    try:
        model = load(args.preset, args.ckpt)
    except FileNotFoundError as exc:
        print(f"warpforge gpt sample: {exc}", file=sys.stderr)
        return 2
    for text in sample(model, args.prompt, args.tokens, args.temperature, args.top_k, args.top_p, args.num,
                       args.seed):
        print(text)
        print("-" * 40)
    return 0


def cmd_info(args) -> int:
    import torch
    import triton

    import warpforge
    print(f"warpforge {warpforge.__version__}  torch {torch.__version__}  triton {triton.__version__}")
    if torch.cuda.is_available():
        print(f"GPU: {torch.cuda.get_device_name()} (capability {torch.cuda.get_device_capability()})")
    else:
        print("GPU: none (backend=None runs the reference; 'triton' needs TRITON_INTERPRET=1 on CPU)")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="warpforge")
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench", help="time every kernel beside its best alternative")
    b.add_argument("--family", default=None, help="one family (default: all)")
    b.add_argument("--quick", action="store_true", help="only the headline cases")
    b.add_argument("--json", default=None, metavar="PATH")
    b.add_argument("--plot", default=None, metavar="PATH", help="PNG of TFLOP/s per case (needs matplotlib)")
    b.add_argument("--match", default=None, metavar="REGEX", help="only cases whose name matches")
    b.add_argument("--list", action="store_true", help="list the cases and exit")
    b.set_defaults(fn=cmd_bench)
    r = sub.add_parser("report", help="render bench JSON files as text tables (markdown)")
    r.add_argument("paths", nargs="+")
    r.set_defaults(fn=cmd_report)
    g = sub.add_parser("gpt", help="the hackable GPT: prepare data, train, sample")
    gsub = g.add_subparsers(dest="gpt_cmd", required=True)
    gp = gsub.add_parser("prepare", help="fetch and prepare the Shakespeare data into the cache directory")
    gp.add_argument("--out", default=None, help="default: $WARPFORGE_CACHE/shakespeare")
    gt = gsub.add_parser("train", help="train a preset (tiny, shakespeare, gpt2-124m)")
    gt.add_argument("--preset", default="tiny")
    gt.add_argument("--out", default=None, help="run directory (default: $WARPFORGE_CACHE/runs/<preset>)")
    gt.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    gt.add_argument("--max-steps", type=int, default=None)
    gt.add_argument("--max-minutes", type=float, default=None)
    gt.add_argument("--data", choices=("shakespeare", "random"), default=None)
    gt.add_argument("--parallel", choices=("ddp", "fsdp"), default=None,
                    help="under torchrun: DDP (default) or FSDP2 (sharded parameters and optimizer state)")
    gt.add_argument("--ddp-bucket-mb", type=float, default=None,
                    help="DDP gradient bucket size in MB (default 25): one all-reduce and one compiled-graph split "
                         "each")
    gt.add_argument("--ddp-bf16-grads", action="store_true", help="DDP: all-reduce gradients in bf16 (half the bytes)")
    gt.add_argument("--compile", choices=("auto", "on", "off", "graphs"), default=None,
                    help="torch.compile the training step; graphs: also replay it from CUDA graphs (auto: graphs "
                         "on CUDA, off on CPU)")
    gs = gsub.add_parser("sample", help="generate text from a trained checkpoint")
    gs.add_argument("--preset", default="tiny")
    gs.add_argument("--ckpt", default=None)
    gs.add_argument("--prompt", default="\n")
    gs.add_argument("--tokens", type=int, default=300)
    gs.add_argument("--temperature", type=float, default=0.8)
    gs.add_argument("--top-k", type=int, default=50)
    gs.add_argument("--top-p", type=float, default=None)
    gs.add_argument("--num", type=int, default=1)
    gs.add_argument("--seed", type=int, default=0)
    g.set_defaults(fn=cmd_gpt)
    i = sub.add_parser("info", help="versions and the device warpforge would use")
    i.set_defaults(fn=cmd_info)
    args = parser.parse_args(argv)
    return args.fn(args)
