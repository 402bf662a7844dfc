"""Command line: `warpforge bench`, `warpforge report`, `warpforge gpt ...`, `warpforge generate`, `warpforge serve`,
`warpforge info`.
Errors a user can act on are one line on stderr and exit code 2; the library's progress lines (the "warpforge"
logger) are shown on stdout."""
from __future__ import annotations

import argparse
import logging
import math
import os
import re
import sys


def _prepare_device(own_process: bool = False):
    """Without a GPU, kernels run through the Triton interpreter, which must be on before triton is imported. Importing
    warpforge (before this module runs) may already have imported triton (torch.compiler's decorators load
    torch._dynamo, which loads triton): then the command, when it is the process's own (`warpforge ...`, not a
    main(argv) call), runs itself again with the interpreter on."""
    import torch
    if not torch.cuda.is_available():
        if "TRITON_INTERPRET" not in os.environ and "triton" in sys.modules and own_process:
            os.environ["TRITON_INTERPRET"] = "1"
            os.execv(sys.executable, [sys.executable, "-m", "warpforge", *sys.argv[1:]])
        os.environ.setdefault("TRITON_INTERPRET", "1")
        return torch.device("cpu")
    return torch.device("cuda")


def _fail(cmd: str, message) -> int:
    print(f"warpforge {cmd}: {message}", file=sys.stderr)
    return 2


# ------------------------------------------------------------------------------------ commands
def cmd_bench(args) -> int:
    device = _prepare_device(args.own_process)
    from .bench import cases as registry
    from .bench import report, runner

    known = registry.families()
    if args.family not in (None, "all") and args.family not in known:
        return _fail("bench", f"unknown family {args.family!r}; known: {', '.join(known)}")
    selected = registry.select(args.family, args.quick)
    if args.match:  # against the case's name, or "family name": a family's name selects its cases too
        selected = [c for c in selected if args.match.search(c.name) or args.match.search(f"{c.family} {c.name}")]
        if not selected:
            return _fail("bench", f"argument --match: no case matches {args.match.pattern!r} (see --list)")
    if args.list:
        for c in selected:
            print(f"{c.family:10s} {c.name}{'  (quick)' if c.quick else ''}")
        return 0
    problem = _bench_output_problem(args)  # before the benchmarks run, not after
    if problem:
        return _fail("bench", problem)
    if device.type == "cpu":
        print("No GPU found: running every kernel through the Triton interpreter at tiny sizes, "
              "checked against its reference. Times are not GPU times.", flush=True)
    checkpoint = (lambda res: report.write_json(res, args.json)) if args.json else None
    result = runner.run(selected, device, log=lambda s: print(s, flush=True), checkpoint=checkpoint)
    print(report.table(result))
    if args.json:
        report.write_json(result, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        report.plot(result, args.plot)
        print(f"wrote {args.plot}")
    # our kernels failing to run, or computing outside their tolerance, fail the command
    failed = [r for r in result["rows"] if r["impl"].startswith("warpforge")
              and (r.get("ms") is None or r.get("ok") is False)]
    return 1 if failed else 0


def _bench_output_problem(args) -> str | None:
    """Why --json or --plot could not be written (None if they can): matplotlib missing, a path that cannot take
    a file."""
    import importlib.util

    from .models.gpt.checkpoint import check_writable
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        return "--plot needs matplotlib (pip install matplotlib, or warpforge[plot])"
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path:
            try:
                check_writable(path)
            except OSError as exc:
                return f"{flag} {path}: cannot write there ({exc})"
    return None


def cmd_report(args) -> int:
    import json

    from .bench import report
    for path in args.paths:
        try:
            with open(path) as f:
                results = json.load(f)
            report.check_result(results)
        except (OSError, ValueError) as exc:
            return _fail("report", f"{path}: {exc}")
        print(f"### {os.path.basename(path)}\n\n```\n{report.table(results)}\n```\n")
    return 0


def cmd_gpt_prepare(args) -> int:
    import subprocess

    from .models.gpt.data import prepare
    try:
        prepare(args.out)
    except (subprocess.CalledProcessError, OSError) as exc:
        return _fail("gpt prepare", f"fetching the data failed ({exc})")
    return 0


def cmd_gpt_train(args) -> int:
    from .models.gpt.data import DataMissing
    from .models.gpt.train import TrainError, train
    settings = dict(max_steps=args.max_steps, max_minutes=args.max_minutes, ckpt_every=args.ckpt_every,
                    data=args.data, compile=args.compile, parallel=args.parallel, ddp_bucket_mb=args.ddp_bucket_mb,
                    batch_scaling=args.batch_scaling, expert_parallel=args.expert_parallel or None,
                    context_parallel=args.context_parallel or None,
                    checkpoint_activations=args.checkpoint_activations or None,
                    ddp_bf16_grads=args.ddp_bf16_grads or None, mlp=args.mlp, monarch_blocks=args.monarch_blocks,
                    tokenizer=args.tokenizer, wandb=args.wandb)
    for name, value in getattr(args, "config_overrides", {}).items():
        if settings.get(name) is not None:
            return _fail("gpt train", f"--{name} is given twice (as a flag and as --{name}=...)")
        settings[name] = value
    if args.monarch_blocks is not None and args.mlp != "monarch":
        return _fail("gpt train", "--monarch-blocks needs --mlp monarch")
    if args.controller is None and (args.procs is not None or args.max_restarts is not None):
        return _fail("gpt train", "--procs and --max-restarts need --controller monarch")
    try:
        if args.controller == "monarch":
            from .models.gpt.controller import monarch_missing, train_with_controller
            problem = monarch_missing()  # before anything else is checked or read
            if problem:
                return _fail("gpt train", problem)
            result = train_with_controller(args.preset, args.out, resume=args.resume, procs=args.procs or 2,
                                           max_restarts=3 if args.max_restarts is None else args.max_restarts,
                                           fail_at=args.fail_at, progress_bar=sys.stderr.isatty(), **settings)
        else:
            result = train(args.preset, args.out, resume=args.resume, progress_bar=sys.stderr.isatty(), **settings)
    except (TrainError, DataMissing) as exc:
        return _fail("gpt train", exc)
    except KeyboardInterrupt:
        print("interrupted: stopped without saving; the last checkpoint stays", file=sys.stderr)
        return 130
    if result.get("restarts"):
        print(f"the trainer mesh was restarted {result['restarts']} time(s) from its last checkpoint")
    vals = [h["val_loss"] for h in result["history"] if "val_loss" in h]
    where = f"step {result['step']} of {result['max_steps']}" + (f", val {vals[-1]:.3f} nats/byte" if vals else "")
    stopped = result["stopped"]
    if stopped == "time limit":
        print(f"stopped early at the time limit of {result['max_minutes']:g} min (--max-minutes): {where}; "
              f"--resume continues")
    elif stopped == "interrupted":
        print(f"stopped early (interrupted): {where}, saved; --resume continues")
        return 130
    elif stopped is not None:
        print(f"stopped early ({stopped}): {where}")
    else:
        print(f"done: {where}")
    return 0


def cmd_gpt_sample(args) -> int:
    from .models.gpt.checkpoint import CheckpointError
    from .models.gpt.sample import load, sample
    from .models.gpt.tokenizer import TokenizerError
    try:
        model = load(args.preset, args.ckpt)
        texts = sample(model, args.prompt, args.tokens, args.temperature, args.top_k, args.top_p, args.num,
                       args.seed)
    except (FileNotFoundError, CheckpointError, TokenizerError, ValueError) as exc:
        return _fail("gpt sample", exc)
    for text in texts:
        print(text)
        print("-" * 40)
    return 0


def cmd_generate(args) -> int:
    from .errors import WarpforgeInputError
    from .serve import LLM, SamplingParams
    try:
        llm = LLM(args.model, dtype=args.dtype, kv_format=args.kv_format, speculative=args.speculative,
                  num_speculative_tokens=args.num_speculative_tokens)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=args.seed, stop=args.stop or [])
        for out in llm.stream(args.prompt, params):  # the text as it is generated
            print(out.new_text, end="", flush=True)
    except WarpforgeInputError as exc:
        return _fail("generate", exc)
    print()
    m = llm.metrics
    spec = f", {m.acceptance_rate:.0%} of drafts accepted" if m.drafted else ""
    print(f"[{m.generated_tokens} tokens, {m.tokens_per_s:.1f} tokens/s, first token {m.mean_ttft * 1e3:.0f} ms"
          f"{spec}]", file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    from .errors import WarpforgeInputError
    from .serve import server
    missing = server.check_installed()
    if missing:
        return _fail("serve", missing)
    try:
        server.serve(args.model, host=args.host, port=args.port, dtype=args.dtype, kv_format=args.kv_format,
                     speculative=args.speculative, num_speculative_tokens=args.num_speculative_tokens)
    except WarpforgeInputError as exc:
        return _fail("serve", exc)
    return 0


def cmd_tune(args) -> int:
    import importlib

    import torch

    from .tune import SWEEPS
    if not torch.cuda.is_available() and not {"-h", "--help"} & set(args.args):
        return _fail("tune", "the sweeps time kernels on a CUDA GPU; none is visible here")
    module = importlib.import_module(f".tune.{SWEEPS[args.name]}", __package__)
    return module.main(args.args) or 0


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


# ------------------------------------------------------------------------------------ arguments
class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line: `warpforge ...: message`, exit code 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _number(kind, ok, expected):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value
    return parse


positive_int = _number(int, lambda v: v >= 1, "a positive integer")
nonnegative_int = _number(int, lambda v: v >= 0, "an integer >= 0")
positive_float = _number(float, lambda v: math.isfinite(v) and v > 0, "a positive number")
temperature = _number(float, lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0")
probability = _number(float, lambda v: 0 < v <= 1, "a probability in (0, 1]")


def rank_step(text):
    """RANK:STEP, two integers >= 0."""
    try:
        rank, step = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected RANK:STEP, got {text!r}") from None
    if rank < 0 or step < 0:
        raise argparse.ArgumentTypeError(f"expected RANK:STEP, got {text!r}")
    return rank, step


def regex(text):
    try:
        return re.compile(text)
    except re.error as exc:
        raise argparse.ArgumentTypeError(f"not a regular expression: {text!r} ({exc})") from None


def _bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="time every kernel beside its best alternative")
    b.add_argument("--family", default=None, help="one family (default: all)")
    b.add_argument("--quick", action="store_true", help="only the headline cases")
    b.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON (after each case)")
    b.add_argument("--plot", default=None, metavar="PATH", help="PNG of TFLOP/s per case (needs matplotlib)")
    b.add_argument("--match", default=None, metavar="REGEX", type=regex,
                   help="only cases whose name, or 'family name', matches (a search, not a full match)")
    b.add_argument("--list", action="store_true", help="list the cases and exit")
    b.set_defaults(fn=cmd_bench)
    r = sub.add_parser("report", help="render bench JSON files as text tables (markdown)")
    r.add_argument("paths", nargs="+", metavar="PATH", help="JSON files written by `warpforge bench --json`")
    r.set_defaults(fn=cmd_report)


def _train_parser(gsub) -> None:
    from .models.gpt.config import PRESETS
    minutes = ", ".join(f"{name}: {p.train.max_minutes or 'none'}" for name, p in PRESETS.items())
    gt = gsub.add_parser("train", help=f"train a preset ({', '.join(PRESETS)})",
                         epilog="Any GPTConfig or TrainConfig field is also a setting, nanoGPT-style: --n_layer=8 "
                                "--lr=3e-4 --max_minutes=none (models/gpt/config.py lists them).")
    gt.add_argument("--preset", default="tiny", help="the model and training settings (default: tiny)")
    gt.add_argument("--out", default=None, help="run directory (default: $WARPFORGE_CACHE/runs/<preset>)")
    gt.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    gt.add_argument("--max-steps", type=positive_int, default=None, help="train to this step (default: the preset's)")
    gt.add_argument("--max-minutes", type=positive_float, default=None,
                    help=f"stop (and save) after this many minutes of training (default: the preset's; {minutes})")
    gt.add_argument("--ckpt-every", type=positive_int, default=None,
                    help="save a checkpoint every this many steps (default: the preset's)")
    gt.add_argument("--data", default=None, metavar="shakespeare|random|DIR",
                    help="the prepared plays, random tokens (throughput), or a folder of train.bin / val.bin of "
                         "uint16 token ids (nanoGPT's format; set --vocab_size=N to fit) (default: the preset's)")
    gt.add_argument("--wandb", default=None, metavar="PROJECT",
                    help="log the loss, throughput and validation to this Weights & Biases project (rank 0; needs "
                         "pip install wandb; WANDB_MODE=offline logs without network)")
    gt.add_argument("--tokenizer", choices=("bytes", "gpt2"), default=None,
                    help="the vocabulary: UTF-8 bytes (the presets' default) or GPT-2's BPE (needs tiktoken; sets "
                         "vocab_size 50304 unless --vocab_size=N); a model setting, so --resume needs the same")
    gt.add_argument("--mlp", choices=("swiglu", "monarch"), default=None,
                    help="the feed-forward's projections: dense nn.Linear (swiglu, the presets' default) or "
                         "MonarchLinear (monarch); a model setting, so --resume needs the same")
    gt.add_argument("--monarch-blocks", type=positive_int, default=None,
                    help="--mlp monarch: blocks per MonarchLinear (default 4; d_model and the feed-forward width must "
                         "divide by it)")
    gt.add_argument("--parallel", choices=("ddp", "zero2", "fsdp"), default=None,
                    help="under torchrun: DDP (default), ZeRO-2 (gradients reduce-scattered as the backward makes "
                         "them, optimizer state sharded) or FSDP2 (parameters sharded too)")
    gt.add_argument("--batch-scaling", choices=("strong", "weak"), default=None,
                    help="under torchrun: the preset's batch is the global batch split across the processes "
                         "(strong, default) or each process's (weak: the global batch grows with the processes)")
    gt.add_argument("--checkpoint-activations", action="store_true",
                    help="recompute each block's activations in the backward instead of keeping them (long sequences; "
                         "about a third more compute)")
    gt.add_argument("--context-parallel", action="store_true",
                    help="under torchrun, dense attention: every process takes a shard of each sequence and attention "
                         "runs as ring attention across them (sequences N times longer than one GPU holds)")
    gt.add_argument("--expert-parallel", action="store_true",
                    help="under torchrun, an MoE model: each process keeps num_experts / N of every MoE layer's "
                         "experts and tokens travel to theirs by all-to-all (DDP for everything else)")
    gt.add_argument("--ddp-bucket-mb", type=positive_float, default=None,
                    help="DDP and ZeRO-2 gradient bucket size in MB (default 25): one all-reduce (ZeRO-2: one "
                         "reduce-scatter) and one compiled-graph split each")
    gt.add_argument("--ddp-bf16-grads", action="store_true", help="DDP: all-reduce gradients in bf16 (half the bytes)")
    gt.add_argument("--controller", choices=("monarch",), default=None,
                    help="one controller process drives a torchmonarch mesh of --procs trainer processes (DDP) and "
                         "restarts it from the last checkpoint when one dies (needs: pip install -e '.[monarch]')")
    gt.add_argument("--procs", type=positive_int, default=None,
                    help="--controller monarch: trainer processes (default 2; on GPUs one per GPU)")
    gt.add_argument("--max-restarts", type=nonnegative_int, default=None,
                    help="--controller monarch: restarts after a trainer process dies before giving up (default 3)")
    gt.add_argument("--fail-at", type=rank_step, default=None, help=argparse.SUPPRESS)  # tests: RANK:STEP exits once
    gt.add_argument("--compile", choices=("auto", "on", "off", "graphs"), default=None,
                    help="torch.compile the training step; graphs: also replay it from CUDA graphs (auto: graphs "
                         "on CUDA, off on CPU)")
    gt.set_defaults(fn=cmd_gpt_train)


def _sample_parser(gsub) -> None:
    from .models.gpt.sample import SEEDS
    seed = _number(int, lambda v: SEEDS[0] <= v <= SEEDS[1], f"an integer from {SEEDS[0]} to {SEEDS[1]}")
    gs = gsub.add_parser("sample", help="generate text from a trained checkpoint")
    gs.add_argument("--preset", default="tiny", help="whose default run to read when --ckpt is not given")
    gs.add_argument("--ckpt", default=None,
                    help="a ckpt.pt, or a run folder / its model.safetensors (read with config.json beside it) "
                         "(default: $WARPFORGE_CACHE/runs/<preset>/ckpt.pt)")
    gs.add_argument("--prompt", default="\n", help="the text to continue (default: a newline)")
    gs.add_argument("--tokens", type=positive_int, default=300, help="bytes to generate per sample (default 300)")
    gs.add_argument("--temperature", type=temperature, default=0.8,
                    help="softmax temperature; 0 is greedy (default 0.8)")
    gs.add_argument("--top-k", type=positive_int, default=50,
                    help="sample among the k most likely bytes (default 50; 256: no limit)")
    gs.add_argument("--top-p", type=probability, default=None,
                    help="sample among the most likely bytes holding this much probability (default: no limit)")
    gs.add_argument("--num", type=positive_int, default=1, help="number of samples (default 1)")
    gs.add_argument("--seed", type=seed, default=0, help="random seed (default 0)")
    gs.set_defaults(fn=cmd_gpt_sample)


def _model_options(p) -> None:
    """How generate and serve load a model."""
    p.add_argument("--speculative", default=None, metavar="ngram|DIR",
                   help="speculative decoding: prompt lookup (ngram) or a draft model's checkpoint directory")
    p.add_argument("--num-speculative-tokens", type=positive_int, default=4, help="drafted tokens a step (default 4)")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None,
                   help="weights' dtype (default: bfloat16 on a GPU, float32 on a CPU)")
    p.add_argument("--kv-format", choices=("bf16", "fp16", "fp32", "fp8", "nvfp4", "mxfp4"), default=None,
                   help="the paged KV cache's format (default: the dtype's)")


def _generate_parser(sub) -> None:
    g = sub.add_parser("generate", help="generate text from a Hugging Face or warpforge GPT checkpoint (serve)")
    g.add_argument("--model", required=True, help="checkpoint directory (config.json, *.safetensors, tokenizer)")
    g.add_argument("--prompt", required=True, help="the text to continue")
    g.add_argument("--max-tokens", type=positive_int, default=64, help="tokens to generate at most (default 64)")
    g.add_argument("--temperature", type=temperature, default=0.0, help="0 is greedy (default 0)")
    g.add_argument("--top-k", type=positive_int, default=None, help="sample among the k most likely tokens")
    g.add_argument("--top-p", type=probability, default=1.0, help="nucleus sampling mass (default 1: off)")
    g.add_argument("--seed", type=nonnegative_int, default=None, help="sampling seed")
    g.add_argument("--stop", action="append", help="a string that ends the output (repeatable)")
    _model_options(g)
    g.set_defaults(fn=cmd_generate)
    sv = sub.add_parser("serve", help="an OpenAI-compatible server (/v1/completions, /v1/chat/completions; the "
                                      "[serve] extra)")
    sv.add_argument("--model", required=True, help="checkpoint directory")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    sv.add_argument("--port", type=positive_int, default=8000, help="port (default 8000)")
    _model_options(sv)
    sv.set_defaults(fn=cmd_serve)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    parser = _Parser(prog="warpforge", description="Portable Triton kernels: benchmarks and the hackable GPT.")
    parser.add_argument("--version", action="version", version=f"warpforge {__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True)
    _bench_parser(sub)
    g = sub.add_parser("gpt", help="the hackable GPT: prepare data, train, sample")
    gsub = g.add_subparsers(dest="gpt_cmd", required=True)
    gp = gsub.add_parser("prepare", help="fetch and prepare the Shakespeare data into the cache directory")
    gp.add_argument("--out", default=None, help="directory (default: $WARPFORGE_CACHE/shakespeare)")
    gp.set_defaults(fn=cmd_gpt_prepare)
    _train_parser(gsub)
    _sample_parser(gsub)
    from .tune import SWEEPS
    t = sub.add_parser("tune", help="sweep a family's tiles on this GPU (the configs.py tables' source)",
                       description="Each sweep times candidate configs at its family's benchmark shapes; "
                                   "`warpforge tune NAME --help` lists its options.")
    t.add_argument("name", choices=sorted(SWEEPS), help="the sweep")
    t.add_argument("args", nargs=argparse.REMAINDER, help="the sweep's own options (e.g. --out FILE.json)")
    t.set_defaults(fn=cmd_tune)
    _generate_parser(sub)
    i = sub.add_parser("info", help="versions and the device warpforge would use")
    i.set_defaults(fn=cmd_info)
    return parser


def config_overrides(extra: list[str]) -> dict:
    """nanoGPT-style `--field=value` settings of any GPTConfig / TrainConfig field (dashes or underscores), typed
    by the field's default (an int, float, bool, str; a field that defaults to None takes a float or 'none')."""
    from dataclasses import MISSING, fields

    from .models.gpt.config import GPTConfig, TrainConfig
    known = {f.name: f.default for cls in (GPTConfig, TrainConfig) for f in fields(cls) if f.default is not MISSING}
    out = {}
    for arg in extra:
        name, sep, text = arg.lstrip("-").partition("=")
        name = name.replace("-", "_")
        if not arg.startswith("--") or not sep or name not in known:
            raise argparse.ArgumentTypeError(f"unrecognized argument {arg!r} (a setting is --field=value, with a "
                                             f"field of GPTConfig or TrainConfig: {', '.join(sorted(known))})")
        default = known[name]
        try:
            if isinstance(default, bool):
                if text.lower() not in ("true", "false", "1", "0"):
                    raise ValueError
                value = text.lower() in ("true", "1")
            elif default is None:
                value = None if text.lower() == "none" else float(text)
            else:
                value = type(default)(text)
        except ValueError:
            kind = "number or none" if default is None else type(default).__name__
            raise argparse.ArgumentTypeError(f"--{name}: expected a {kind}, got {text!r}") from None
        out[name] = value
    return out


def main(argv=None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    args.own_process = argv is None
    if extra:
        if not (args.cmd == "gpt" and args.gpt_cmd == "train"):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        try:
            args.config_overrides = config_overrides(extra)
        except argparse.ArgumentTypeError as exc:
            return _fail("gpt train", exc)
    handler = logging.StreamHandler(sys.stdout)  # the library's progress lines, as the user's output
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("warpforge")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        return args.fn(args)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
