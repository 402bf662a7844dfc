"""Training loop: AdamW, warmup + cosine schedule, gradient clipping, bf16 autocast on GPU, periodic
evaluation, atomic checkpoints (model, optimizer, RNG, data position) with --resume.
Ctrl-C stops after the step under way and saves it; a second Ctrl-C stops at once (the last checkpoint stays).
Several GPUs: launch with torchrun (DDP; --parallel zero2 or fsdp; the global batch stays the preset's unless
--batch-scaling weak; --expert-parallel shards MoE experts, --context-parallel each sequence: experts.py and
warpforge.distributed). Checkpoints hold full (unsharded) weights and optimizer state in every mode.

The parts: `resolve_run` (preset, overrides, resume checks), `_distributed` (processes and device), `Trainer`
(builds the model and optimizer, wraps them for parallelism and compilation, runs the loop), `Checkpointer`
(checkpoint.py). Progress goes to the "warpforge" logger.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Callable, Optional

import torch

from ...errors import WarpforgeInputError
from ...profiling import StepProfiler
from ...runtime import device_spec, resolve_backend
from . import experts as expert_parallel
from .checkpoint import Checkpointer, CheckpointError, TrainError, check_writable, load_weights, read_checkpoint
from .config import GPTConfig, TrainConfig, from_dict, preset
from .data import Batches, cache_dir, load_split, load_tokens, tokenized_split
from .tokenizer import GPT2_MODEL_VOCAB, TokenizerError
from .model import GPT

__all__ = ["train", "TrainError", "CheckpointError", "resolve_run", "Trainer", "lr_at", "evaluate"]

log = logging.getLogger(__name__)
LOG_EVERY = 10  # steps between loss readings (each one waits for the device)


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


# ---------------------------------------------------------------------------------------- the run
@dataclass(frozen=True)
class Run:
    """What a run is before anything is built: its preset, configs, directory and (resumed) checkpoint."""
    preset: str
    model_cfg: GPTConfig
    train_cfg: TrainConfig
    out: Path
    ckpt: Optional[dict] = None

    @property
    def ckpt_path(self) -> Path:
        return self.out / "ckpt.pt"


def resolve_run(preset_name: str, out_dir: str | None = None, resume: bool = False, **overrides) -> Run:
    """The preset with overrides (TrainConfig or GPTConfig fields; None: not given). A resumed run keeps the train
    config it was started with (so its schedule and data continue), except for overrides given again; its model
    config must be the one the overrides make."""
    try:
        p = preset(preset_name)
    except ValueError as exc:
        raise TrainError(str(exc)) from None
    overrides = {k: v for k, v in overrides.items() if v is not None}
    model_fields = {f.name for f in fields(GPTConfig)}
    model_overrides = {k: overrides.pop(k) for k in list(overrides) if k in model_fields}
    if model_overrides.get("tokenizer") == "gpt2" and "vocab_size" not in model_overrides and \
            p.model.vocab_size < GPT2_MODEL_VOCAB:
        model_overrides["vocab_size"] = GPT2_MODEL_VOCAB  # GPT-2's ids, rounded up to 64 rows
    try:
        tcfg = replace(p.train, **overrides)
    except TypeError as exc:
        raise TrainError(f"unknown training setting: {exc}") from None
    try:
        mcfg = replace(p.model, **model_overrides)
    except ValueError as exc:  # a GPTConfig checks its fields (WarpforgeInputError is a ValueError)
        raise TrainError(str(exc)) from None
    out = Path(out_dir) if out_dir else cache_dir().parent / "runs" / preset_name
    run = Run(preset_name, mcfg, tcfg, out)
    if run.ckpt_path.exists() and not resume:
        raise TrainError(f"{run.ckpt_path} exists: pass --resume to continue it, or --out for a new run")
    if resume:
        if not run.ckpt_path.exists():
            raise TrainError(f"nothing to resume: no checkpoint at {run.ckpt_path}")
        ckpt = read_checkpoint(run.ckpt_path)
        try:
            same_model = from_dict(GPTConfig, ckpt["model_cfg"]) == mcfg
            tcfg = replace(from_dict(TrainConfig, ckpt["train_cfg"]), **overrides)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"{run.ckpt_path}: its configs do not read here ({exc})") from None
        if not same_model:
            raise TrainError(f"{run.ckpt_path} was trained with another model config than preset {preset_name!r} "
                             "with these settings")
        run = replace(run, train_cfg=tcfg, ckpt=ckpt)
    _check(run.train_cfg)
    if run.ckpt and run.train_cfg.max_steps < run.ckpt["step"]:  # it would rewrite step N as done "of" fewer
        raise TrainError(f"max_steps: expected at least the step of {run.ckpt_path} ({run.ckpt['step']}), got "
                         f"{run.train_cfg.max_steps}")
    return run


def _wandb_run(run: Run, rank: int):
    """With TrainConfig.wandb set, rank 0's Weights & Biases run (its config: both configs and the preset); None
    otherwise. WANDB_MODE=offline logs without network."""
    if not run.train_cfg.wandb or rank != 0:
        return None
    try:
        import wandb
    except ImportError:
        raise TrainError("--wandb needs the wandb package: pip install wandb") from None
    return wandb.init(project=run.train_cfg.wandb, dir=str(run.out), name=run.out.name,
                      config={"preset": run.preset, "model": asdict(run.model_cfg), "train": asdict(run.train_cfg)})


def _data(source: str, vocab_size: int, tokenizer: str = "bytes"):
    """(train, val) token arrays: None for random tokens, the prepared plays (as bytes, or tokenized once into the
    cache by another tokenizer), or a folder of uint16 tokens."""
    if source == "random":
        return None, None
    if source == "shakespeare":
        if tokenizer != "bytes":
            try:
                return tokenized_split("train", tokenizer), tokenized_split("val", tokenizer)
            except TokenizerError as exc:
                raise TrainError(str(exc)) from None
        return load_split("train"), load_split("val")
    return load_tokens(Path(source), "train", vocab_size), load_tokens(Path(source), "val", vocab_size)


def _check(tcfg: TrainConfig) -> None:
    if tcfg.parallel not in ("ddp", "zero2", "fsdp"):
        raise TrainError(f"parallel: expected 'ddp', 'zero2' or 'fsdp', got {tcfg.parallel!r}")
    if tcfg.batch_scaling not in ("strong", "weak"):
        raise TrainError(f"batch_scaling: expected 'strong' or 'weak', got {tcfg.batch_scaling!r}")
    if tcfg.compile not in ("on", "off", "auto", "graphs"):
        raise TrainError(f"compile: expected 'on', 'off', 'graphs' or 'auto', got {tcfg.compile!r}")
    if not tcfg.ddp_bucket_mb > 0:
        raise TrainError(f"ddp_bucket_mb: expected a positive size in MB, got {tcfg.ddp_bucket_mb!r}")
    for name in ("max_steps", "batch_size", "ckpt_every", "eval_every", "eval_batches"):
        if not (isinstance(getattr(tcfg, name), int) and getattr(tcfg, name) >= 1):
            raise TrainError(f"{name}: expected a positive integer, got {getattr(tcfg, name)!r}")
    if tcfg.max_minutes is not None and not (math.isfinite(tcfg.max_minutes) and tcfg.max_minutes > 0):
        raise TrainError(f"max_minutes: expected a positive number of minutes or None, got {tcfg.max_minutes!r}")
    if tcfg.teacher and not Path(tcfg.teacher).exists():
        raise TrainError(f"teacher: expected a trained run's folder or its ckpt.pt, got {tcfg.teacher!r}")
    if tcfg.data not in ("shakespeare", "random") and not Path(tcfg.data).is_dir():
        raise TrainError(f"data: expected 'shakespeare', 'random' or a folder of train.bin / val.bin (uint16 "
                         f"tokens, nanoGPT's format), got {tcfg.data!r}")


@dataclass(frozen=True)
class Env:
    """This process's place: rank of world, the device, whether parameters are sharded (FSDP2), whether gradients
    and optimizer state are (ZeRO-2), and the sequences this process takes a step."""
    rank: int
    world: int
    device: torch.device
    fsdp: bool
    zero: bool = False
    batch: int = 1
    ep: bool = False  # MoE experts sharded over the processes (expert parallelism)
    cp: bool = False  # each sequence sharded over the processes (context parallelism)


def _distributed(tcfg: TrainConfig) -> Env:
    """One process, or one of torchrun's (RANK set): the process group is made here."""
    rank, world, local = 0, 1, 0
    if "RANK" in os.environ:
        import torch.distributed as dist
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        rank, world, local = dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0))
        if torch.cuda.is_available():
            torch.cuda.set_device(local)
    device = torch.device(f"cuda:{local}" if torch.cuda.is_available() else "cpu")
    cp = world > 1 and tcfg.context_parallel
    if cp:  # every process reads the same sequences and takes its shard of each
        batch = tcfg.batch_size
    elif tcfg.batch_scaling == "weak":
        batch = tcfg.batch_size
    elif tcfg.batch_size % world:
        raise TrainError(f"batch size {tcfg.batch_size} does not split over {world} processes (or keep it per "
                         f"process: --batch-scaling weak)")
    else:
        batch = tcfg.batch_size // world
    multi = world > 1
    for flag, on in (("--expert-parallel", tcfg.expert_parallel), ("--context-parallel", tcfg.context_parallel)):
        if multi and on and tcfg.parallel != "ddp":
            raise TrainError(f"{flag} runs with --parallel ddp, not {tcfg.parallel}")
    if cp and tcfg.expert_parallel:
        raise TrainError("--context-parallel and --expert-parallel together are not supported; pick one")
    if cp and tcfg.teacher:  # the teacher would see a shard of each sequence as if it were the whole
        raise TrainError("--context-parallel with --teacher is not supported")
    return Env(rank, world, device, multi and tcfg.parallel == "fsdp", multi and tcfg.parallel == "zero2", batch,
               multi and tcfg.expert_parallel, cp)


# ------------------------------------------------------------------------------ model, parallelism
def _build(run: Run, env: Env) -> tuple[GPT, torch.optim.Optimizer, list[str]]:
    """The model (with the checkpoint's weights, then sharded under FSDP or expert parallelism), its AdamW, and the
    names of the expert parameters that expert parallelism sharded."""
    tcfg = run.train_cfg
    torch.manual_seed(tcfg.seed)
    model = GPT(run.model_cfg).to(env.device)
    if run.ckpt:
        load_weights(model, run.ckpt["model"], run.ckpt_path)  # full weights, before any sharding
    if env.fsdp:
        _shard(model)
    if env.cp:
        _check_context_parallel(run.model_cfg, env.world)
    experts = []
    if env.ep:
        if not run.model_cfg.moe_experts or run.model_cfg.moe_experts % env.world:
            raise TrainError(f"--expert-parallel needs an MoE model whose experts ({run.model_cfg.moe_experts}) "
                             f"divide over the {env.world} processes")
        experts = expert_parallel.shard(model)
    if env.zero:  # gradients reduce-scattered in buckets as the backward makes them; AdamW on this rank's shards
        from ...distributed.zero import ShardedAdamW
        optim = ShardedAdamW(model.parameters(), lr=tcfg.lr, betas=(0.9, 0.95), weight_decay=tcfg.weight_decay,
                             bucket_mb=tcfg.ddp_bucket_mb)
    else:
        optim = torch.optim.AdamW(model.parameters(), lr=tcfg.lr, betas=(0.9, 0.95), weight_decay=tcfg.weight_decay,
                                  fused=env.device.type == "cuda")
    return model, optim, experts


def _check_context_parallel(mcfg: GPTConfig, world: int) -> None:
    """A model whose sequences split over `world` processes: dense attention in zigzag halves (2 per process),
    sparse attention in whole blocks (one chunk per process)."""
    if mcfg.attention not in ("mha", "sparse"):
        raise TrainError(f"--context-parallel needs attention 'mha' or 'sparse', not {mcfg.attention!r}")
    unit = world * mcfg.sparse_block if mcfg.attention == "sparse" else 2 * world
    if mcfg.seq_len % unit:
        raise TrainError(f"--context-parallel: seq_len ({mcfg.seq_len}) must divide into {unit} "
                         f"({'sparse blocks' if mcfg.attention == 'sparse' else 'zigzag halves'} over {world} "
                         f"processes)")


def _teacher(tcfg: TrainConfig, mcfg: GPTConfig, env: Env) -> GPT | None:
    """The frozen model a distilled run learns from (tcfg.teacher), checked against the model it teaches."""
    if not tcfg.teacher:
        return None
    if mcfg.moe_experts or mcfg.attention == "sparse":  # their auxiliary losses live in the data loss's path
        raise TrainError("teacher: distilling into MoE or sparse-attention models is not supported (their auxiliary "
                         "losses are added to the data's cross-entropy); train a dense model")
    from .sample import load
    try:
        teacher = load(ckpt=tcfg.teacher, device=env.device)
    except (FileNotFoundError, CheckpointError) as exc:
        raise TrainError(f"teacher: {exc}") from None
    tc = teacher.cfg
    if (tc.vocab_size, tc.tokenizer) != (mcfg.vocab_size, mcfg.tokenizer):
        raise TrainError(f"teacher: its vocabulary ({tc.vocab_size} {tc.tokenizer}) is not the model's "
                         f"({mcfg.vocab_size} {mcfg.tokenizer})")
    if tc.seq_len < mcfg.seq_len:
        raise TrainError(f"teacher: its seq_len ({tc.seq_len}) is shorter than the model's ({mcfg.seq_len})")
    return teacher.requires_grad_(False)


def distill_loss(logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of KL(teacher || model) in nats, from both models' logits [..., vocab] (computed in fp32)."""
    s = logits.float().reshape(-1, logits.shape[-1]).log_softmax(-1)
    t = teacher_logits.float().reshape(-1, teacher_logits.shape[-1]).log_softmax(-1)
    return torch.nn.functional.kl_div(s, t, log_target=True, reduction="batchmean")


def _shard(model: GPT) -> None:
    """FSDP2: each block its own unit (its parameters gathered for its forward and backward, then freed), the
    embedding, final norm and (tied) head in the root's."""
    from torch.distributed.fsdp import fully_shard
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)


def _wrap(model: GPT, tcfg: TrainConfig, env: Env, experts: list[str]):
    """(the module the training step calls, whether it replays CUDA graphs): DDP across processes (FSDP2 has
    sharded the model in place already), then torch.compile by tcfg.compile. Checkpoints and evaluation keep
    using the plain module."""
    net = model
    if env.world > 1 and not (env.fsdp or env.zero):
        from torch.nn.parallel import DistributedDataParallel
        if experts:  # each rank holds different experts: not averaged (their gradients already sum every rank's)
            expert_parallel.ddp_ignore(model, experts)
        # gradients live in the buckets (no copy into them after each backward)
        net = DistributedDataParallel(model, device_ids=[env.device.index] if env.device.type == "cuda" else None,
                                      bucket_cap_mb=tcfg.ddp_bucket_mb, gradient_as_bucket_view=True,
                                      broadcast_buffers=False)  # rotary tables: the same on every rank
        if tcfg.ddp_bf16_grads:  # half the all-reduce bytes; the sum is rounded to bf16 once per step
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
            net.register_comm_hook(None, bf16_compress_hook)
    cuda = env.device.type == "cuda"
    # auto on CUDA = graphs: compiled, the step is still bound by launching its kernels one by one, and DDP only
    # scales without that bound. FSDP2's per-block all-gathers are not captured: auto compiles without graphs there.
    if tcfg.compile == "graphs" and (env.zero or env.ep or env.cp):
        raise TrainError("--compile graphs: not with --parallel zero2, --expert-parallel or --context-parallel (their "
                         "collectives and host reads run inside the step; use --compile on or auto)")
    # ZeRO-2's gradient hooks launch collectives from the backward: not yet run under graphs, so auto leaves them out.
    graphs = tcfg.compile == "graphs" or (tcfg.compile == "auto" and cuda and
                                          not (env.fsdp or env.zero or env.ep or env.cp))
    # expert parallelism reads the all-to-all's token counts on the host, ring attention exchanges K/V point to
    # point between its blocks: auto leaves both uncompiled
    if tcfg.compile in ("on", "graphs") or (tcfg.compile == "auto" and cuda and not (env.ep or env.cp)):
        net = torch.compile(net, mode="reduce-overhead" if graphs else None)
    return net, graphs


def mfu(flops_per_token: float, tokens_per_s: float, env: Env) -> float | None:
    """Model FLOP utilisation per GPU (tokens_per_s counts the global batch, which `world` GPUs share) against
    the GPU's dense bf16 peak; None off CUDA."""
    if env.device.type != "cuda":
        return None
    return flops_per_token * tokens_per_s / (env.world * device_spec(env.device).bf16_flops)


@torch.no_grad()
def evaluate(model, val, cfg: TrainConfig, device, autocast, context=None) -> float:
    """Mean validation loss over cfg.eval_batches fixed batches. context: context parallelism's settings (every
    rank evaluates its shards; the ranks' losses are averaged)."""
    model.eval()
    batches = Batches(val, model.cfg.seq_len, cfg.batch_size, seed=0)  # the same batches at every eval
    total = 0.0
    for _ in range(cfg.eval_batches):
        x, y = batches.next(device)
        if context is not None:
            x, y = context.shard(x), context.shard(y)
        with autocast():
            loss = model(x, y)
        total += (_rank_mean(loss) if context is not None else loss).item()
    model.train()
    return total / cfg.eval_batches


def _rank_mean(x: torch.Tensor) -> torch.Tensor:
    """x averaged over the processes (a collective)."""
    import torch.distributed as dist
    x = x.detach().clone()
    dist.all_reduce(x)
    return x / dist.get_world_size()


# ---------------------------------------------------------------------------------------- the loop
class _StopRequest:
    """While active, Ctrl-C (SIGINT) only asks the loop to stop at the end of the step under way, whose state
    (weights, optimizer, data position) is then consistent. In one process a second Ctrl-C raises
    KeyboardInterrupt at once; under torchrun (which forwards the signal) later ones are ignored."""

    def __init__(self, world: int):
        self.world, self.requested, self.previous = world, False, None

    def __enter__(self):
        main = threading.current_thread() is threading.main_thread()
        if main and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            self.previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested and self.world == 1:
            raise KeyboardInterrupt
        if not self.requested:
            log.warning("interrupted: stopping after this step and saving it (Ctrl-C again: stop at once)")
        self.requested = True

    def __exit__(self, *exc):
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


def _check_backend(env: Env) -> None:
    """The backend the environment picks (WARPFORGE_BACKEND) runs here: refused now, not at the first step."""
    try:
        resolve_backend(None, env.device)
    except WarpforgeInputError as exc:
        raise TrainError(f"WARPFORGE_BACKEND={os.environ.get('WARPFORGE_BACKEND', '')!r}: {exc}") from None


def _check_out(run: Run, env: Env) -> None:
    """The run's directory takes the checkpoint (rank 0 writes it): refused now, not at the first save. It is
    made here, so this comes after the other checks that write nothing."""
    if env.rank != 0:
        return
    try:
        check_writable(run.ckpt_path)
    except OSError as exc:
        raise TrainError(f"cannot write the run's checkpoint to {run.out}: {exc}") from None


class Trainer:
    """One process's part of a run: model, optimizer, data and checkpoints, and the loop. fit() trains until
    max_steps, the time limit, Ctrl-C or stop_at_step, saves, and returns the result."""

    def __init__(self, run: Run, env: Env, stop_at_step: int | None = None, progress_bar: bool = False,
                 on_step: Optional[Callable[[int, torch.Tensor], None]] = None):
        _check_backend(env)
        self.run, self.env, self.cfg = run, env, run.train_cfg
        self.stop_at_step, self.progress_bar, self.on_step = stop_at_step, progress_bar, on_step
        self.logger = None  # fit() starts the --wandb run
        train_data, self.val_data = _data(self.cfg.data, run.model_cfg.vocab_size, run.model_cfg.tokenizer)
        _check_out(run, env)
        self.model, self.optim, self.experts = _build(run, env)
        self.model.checkpoint_blocks = self.cfg.checkpoint_activations
        self.context = None
        if env.cp:  # every attention layer attends across the processes; each step feeds this rank's shards
            from ...distributed.context import context_parallel
            self.context = context_parallel(self.model)
        self.teacher = _teacher(self.cfg, run.model_cfg, env)
        mcfg = run.model_cfg
        self.batches = Batches(train_data, mcfg.seq_len, env.batch,
                               seed=self.cfg.seed + (0 if env.cp else env.rank), vocab_size=mcfg.vocab_size)
        self.ckpt = Checkpointer(run.out, run.preset, mcfg, self.cfg, self.model, self.optim, self.batches,
                                 rank=env.rank, world=env.world, fsdp=env.fsdp, experts=self.experts)
        self.step, self.history = self.ckpt.restore(run.ckpt) if run.ckpt else (0, [])
        self.net, self.graphs = _wrap(self.model, self.cfg, env, self.experts)
        self.tokens_per_step = env.batch * (1 if env.cp else env.world) * mcfg.seq_len
        self.flops_per_token = self.model.flops_per_token()
        self.profiler = StepProfiler(env.rank == 0)  # WARPFORGE_PROFILE_STEPS=A:B: wall vs kernel time

    def autocast(self):
        if self.env.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def fit(self) -> dict:
        self._announce()
        self.logger = _wandb_run(self.run, self.env.rank)
        self.start = self.last_t = time.time()
        self.last_step = self.step
        bar = _Progress(self.cfg.max_steps, self.step, self.env.rank == 0, self.progress_bar)
        try:
            with _StopRequest(self.env.world) as stop:
                stopped = self._loop(stop, bar)
        except KeyboardInterrupt:
            log.warning(f"stopped at once at step {self.step}: the last checkpoint stays")
            raise
        finally:
            bar.close()
        if stopped != "interrupted":
            self._final_evaluation()
        self.ckpt.save(self.step, self.history, "interrupt" if stopped == "interrupted" else "end")
        if self.logger is not None:
            self.logger.finish()
        return {"step": self.step, "history": self.history, "out": str(self.run.out),
                "params": self.model.num_params(), "stopped": stopped, "max_steps": self.cfg.max_steps,
                "max_minutes": self.cfg.max_minutes}

    def _announce(self) -> None:
        if self.env.rank != 0:
            return
        limit = f"{self.cfg.max_minutes:g} min (--max-minutes)" if self.cfg.max_minutes else "none"
        log.info(f"{self.run.preset}: {self.model.num_params() / 1e6:.2f}M parameters, {self.tokens_per_step} "
                 f"tokens/step, device {self.env.device}, {self.env.world} process(es)")
        log.info(f"steps {self.step} -> {self.cfg.max_steps}; time limit {limit}")
        if self.experts:
            log.info(f"expert parallel: each process holds {self.run.model_cfg.moe_experts // self.env.world} of "
                     f"every MoE layer's {self.run.model_cfg.moe_experts} experts")
        if self.teacher is not None:
            log.info(f"distilling from {self.cfg.teacher}: the loss is KL(teacher || model) per token, the "
                     f"validation the data's cross-entropy")

    def _loop(self, stop: _StopRequest, bar: "_Progress") -> str | None:
        """Steps until max_steps (None) or a stop: "stop_at_step", "time limit", "interrupted"."""
        cfg = self.cfg
        while self.step < cfg.max_steps:
            reason = self._stop_reason(stop)
            if reason:
                return reason
            loss = self._train_step()
            self.step += 1
            self.profiler.after_step(self.step)
            if self.step % LOG_EVERY == 0 or self.step == cfg.max_steps:
                self._record(loss, bar)
            if self.val_data is not None and (self.step % cfg.eval_every == 0 or self.step == cfg.max_steps):
                self._evaluate()
            if self.step % cfg.ckpt_every == 0:
                self.ckpt.save(self.step, self.history, "periodic")
            if self.on_step is not None:  # after the step's checkpoint (the controller's loss stream)
                self.on_step(self.step, loss)
        return None

    def _stop_reason(self, stop: _StopRequest) -> str | None:
        if self.stop_at_step is not None and self.step >= self.stop_at_step:
            return "stop_at_step"  # as a kill would, after the checkpoint of that step (tests)
        if self.env.world > 1 and self.step % LOG_EVERY:
            return None  # the ranks agree where the loss is read anyway (a wait for the device)
        reason = 0
        if stop.requested:
            reason = 2
        elif self.cfg.max_minutes is not None and time.time() - self.start > 60 * self.cfg.max_minutes:
            reason = 1
        if self.env.world > 1:  # every rank stops at the same step, or their collectives would hang
            import torch.distributed as dist
            flag = torch.tensor([reason], device=self.env.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            reason = int(flag.item())
        if reason == 1 and self.env.rank == 0:
            log.info(f"time limit of {self.cfg.max_minutes:g} min reached at step {self.step}")
        return (None, "time limit", "interrupted")[reason]

    def _train_step(self) -> torch.Tensor:
        for g in self.optim.param_groups:
            g["lr"] = lr_at(self.step, self.cfg)
        x, y = self.batches.next(self.env.device)
        if self.context is not None:
            x, y = self.context.shard(x), self.context.shard(y)
        if self.graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with self.autocast():
            if self.teacher is None:
                loss = self.net(x, y)
            else:
                with torch.no_grad():
                    want = self.teacher(x)
                loss = distill_loss(self.net(x), want)
        loss.backward()
        if self.env.zero:  # the gradients live in the optimizer's shards
            self.optim.clip_grad_norm_(self.cfg.grad_clip)
        elif self.experts:
            expert_parallel.average_grads(self.model, self.experts, self.env.world)
            expert_parallel.clip_grad_norm_(self.model, self.experts, self.cfg.grad_clip)
        else:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        return loss

    def _record(self, loss: torch.Tensor, bar: "_Progress") -> None:
        lval = (_rank_mean(loss) if self.context is not None else loss).item()  # context parallel: a shard's loss
        now = time.time()
        tps = self.tokens_per_step * (self.step - self.last_step) / max(now - self.last_t, 1e-9)
        self.last_t, self.last_step = now, self.step
        util = mfu(self.flops_per_token, tps, self.env)
        self._log({"step": self.step, "loss": lval, "tokens_per_s": tps, "mfu": util, "elapsed_s": now - self.start})
        bar.update(self.step, f"loss {lval:.3f} | {tps:,.0f} tok/s" + (f" | MFU {100 * util:.1f}%" if util else ""))

    def _log(self, entry: dict) -> None:
        """A history entry: kept (checkpoints carry the history) and, with --wandb, sent to the run's logger."""
        self.history.append(entry)
        if self.logger is not None:
            self.logger.log({k: v for k, v in entry.items() if k != "step" and v is not None}, step=entry["step"])

    def _evaluate(self) -> None:
        # FSDP: every rank takes part in the forward's all-gathers; expert parallelism: in its all-to-alls; context
        # parallelism: in its rings
        if not (self.env.rank == 0 or self.env.fsdp or self.env.ep or self.env.cp):
            return
        v = evaluate(self.model, self.val_data, self.cfg, self.env.device, self.autocast, self.context)
        self._log({"step": self.step, "val_loss": v, "elapsed_s": time.time() - self.start})
        if self.env.rank == 0:
            log.info(f"step {self.step}: val {v:.3f} nats/byte")

    def _final_evaluation(self) -> None:
        """The last step's validation, unless the loop made it."""
        if self.val_data is not None and \
                not any(h.get("step") == self.step and "val_loss" in h for h in self.history):
            self._evaluate()


def train(preset_name: str, out_dir: str | None = None, resume: bool = False, *, stop_at_step: int | None = None,
          progress_bar: bool = False, on_step: Optional[Callable[[int, torch.Tensor], None]] = None,
          **overrides) -> dict:
    """Train a preset; overrides replace TrainConfig fields (None: keep). Returns {"step", "history", "out",
    "params", "stopped", "max_steps", "max_minutes"}: stopped is None when max_steps was reached, else "time
    limit", "interrupted" (Ctrl-C: saved after the step under way) or "stop_at_step" (ends the run there as a
    kill would, after its checkpoint: tests, time-boxed jobs). progress_bar: a tqdm bar, where installed, instead
    of a log line every tenth of the run. on_step(step, loss): called after every step (and its checkpoint) with
    this rank's loss tensor (reading it waits for the device)."""
    run = resolve_run(preset_name, out_dir, resume, **overrides)
    env = _distributed(run.train_cfg)
    result = Trainer(run, env, stop_at_step, progress_bar, on_step).fit()
    if "RANK" in os.environ:
        # torchrun's process group, made by _distributed: torn down here rather than at interpreter exit, where gloo's
        # threads were seen to abort a rank ("terminate called without an active exception") after a finished run
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
    return result


class _Progress:
    """tqdm (when asked for and installed), else a log line every 10% of the run."""

    def __init__(self, total, start, enabled, bar: bool):
        self.total, self.enabled, self.bar = total, enabled, None
        self.next_line = start
        if enabled and bar:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, initial=start, dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, step, text):
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix_str(text, refresh=True)
        elif step >= self.next_line:
            log.info(f"step {step}/{self.total} | {text}")
            self.next_line = step + max(1, self.total // 10)

    def close(self):
        if self.bar is not None:
            self.bar.close()
