"""Training loop: AdamW, warmup + cosine schedule, gradient clipping, bf16 autocast on GPU, periodic
evaluation, atomic checkpoints (model, optimizer, RNG, data position) with --resume, Ctrl-C saves first.
Several GPUs: launch with torchrun (DDP, or FSDP2 with --parallel fsdp; the global batch stays the preset's).
Checkpoints hold full (unsharded) weights and optimizer state either way."""
from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from ...profiling import StepProfiler
from .config import GPTConfig, TrainConfig, preset
from .data import Batches, cache_dir, load_split
from .model import GPT

PEAK_BF16 = 989e12  # H100/H200 dense bf16 datasheet rate, the MFU denominator


class TrainError(RuntimeError):
    """A one-line, user-facing reason a run cannot start (nothing has been written)."""


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def save_atomic(obj, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)  # a crash mid-write never leaves a torn checkpoint


def _distributed():
    if "RANK" not in os.environ:
        return 0, 1, None
    import torch.distributed as dist
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    local = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
    return dist.get_rank(), dist.get_world_size(), local


@torch.no_grad()
def evaluate(model, val, cfg: TrainConfig, device, autocast) -> float:
    model.eval()
    batches = Batches(val, model.cfg.seq_len, cfg.batch_size, seed=0)  # the same batches at every eval
    total = 0.0
    for _ in range(cfg.eval_batches):
        x, y = batches.next(device)
        with autocast():
            total += model(x, y).item()
    model.train()
    return total / cfg.eval_batches


def train(preset_name: str, out_dir: str | None = None, resume: bool = False, log=print,
          stop_at_step: int | None = None, **overrides) -> dict:
    """Train a preset; overrides replace TrainConfig fields. A resumed run keeps the train config it was
    started with (so its schedule and data continue), except for overrides given again. stop_at_step ends
    the run there as a kill would, after its checkpoint (tests, time-boxed jobs)."""
    try:
        p = preset(preset_name)
    except ValueError as exc:
        raise TrainError(str(exc)) from None
    overrides = {k: v for k, v in overrides.items() if v is not None}
    tcfg = replace(p.train, **overrides)
    mcfg: GPTConfig = p.model
    out = Path(out_dir) if out_dir else cache_dir().parent / "runs" / preset_name
    ckpt_path = out / "ckpt.pt"
    if ckpt_path.exists() and not resume:
        raise TrainError(f"{ckpt_path} exists: pass --resume to continue it, or --out for a new run")
    ckpt = None
    if resume:
        if not ckpt_path.exists():
            raise TrainError(f"nothing to resume: no checkpoint at {ckpt_path}")
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        if ckpt["model_cfg"] != asdict(mcfg):
            raise TrainError(f"{ckpt_path} was trained with another model config than preset {preset_name!r}")
        tcfg = replace(TrainConfig(**ckpt["train_cfg"]), **overrides)

    if tcfg.parallel not in ("ddp", "fsdp"):
        raise TrainError(f"parallel: expected 'ddp' or 'fsdp', got {tcfg.parallel!r}")
    if tcfg.compile not in ("on", "off", "auto", "graphs"):
        raise TrainError(f"compile: expected 'on', 'off', 'graphs' or 'auto', got {tcfg.compile!r}")
    if not tcfg.ddp_bucket_mb > 0:
        raise TrainError(f"ddp_bucket_mb: expected a positive size in MB, got {tcfg.ddp_bucket_mb!r}")
    rank, world, local = _distributed()
    fsdp = world > 1 and tcfg.parallel == "fsdp"
    device = torch.device(f"cuda:{local or 0}" if torch.cuda.is_available() else "cpu")
    if tcfg.batch_size % world:
        raise TrainError(f"batch size {tcfg.batch_size} does not split over {world} processes")
    train_data = None if tcfg.data == "random" else load_split("train")
    val_data = None if tcfg.data == "random" else load_split("val")
    torch.manual_seed(tcfg.seed)
    model = GPT(mcfg).to(device)
    if ckpt:
        model.load_state_dict(ckpt["model"])  # full weights, before any sharding
    if fsdp:
        _shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=tcfg.lr, betas=(0.9, 0.95), weight_decay=tcfg.weight_decay,
                              fused=device.type == "cuda")
    batches = Batches(train_data, mcfg.seq_len, tcfg.batch_size // world, seed=tcfg.seed + rank,
                      vocab_size=mcfg.vocab_size)
    history, step = [], 0
    if ckpt:
        _load_optimizer(model, optim, ckpt["optim"], fsdp, ckpt_path)
        if len(ckpt["data_state"]) != world:
            raise TrainError(f"{ckpt_path} was written by {len(ckpt['data_state'])} process(es), not {world}")
        batches.restore(ckpt["data_state"][rank])
        torch.set_rng_state(ckpt["rng"])
        history, step = ckpt["history"], ckpt["step"]
        log(f"resumed {ckpt_path} at step {step}")
    if world > 1 and not fsdp:
        from torch.nn.parallel import DistributedDataParallel
        # gradients live in the buckets (no copy into them after each backward)
        net = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                      bucket_cap_mb=tcfg.ddp_bucket_mb, gradient_as_bucket_view=True,
                                      broadcast_buffers=False)  # rotary tables: the same on every rank
        if tcfg.ddp_bf16_grads:  # half the all-reduce bytes; the sum is rounded to bf16 once per step
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
            net.register_comm_hook(None, bf16_compress_hook)
    else:
        net = model  # FSDP2 shards the module in place
    # auto on CUDA = graphs: the compiled step is still bound by launching ~850 kernels (gpt2-124m, H200: 46.9 ms
    # a step, 38.9 ms of kernels; from CUDA graphs 40.1 ms), and DDP only scales without that bound (0.94x -> 1.68x)
    # (FSDP2's per-block all-gathers are not captured: auto compiles without graphs there)
    graphs = tcfg.compile == "graphs" or (tcfg.compile == "auto" and device.type == "cuda" and not fsdp)
    if tcfg.compile in ("on", "graphs") or (tcfg.compile == "auto" and device.type == "cuda"):
        # checkpoints and evaluation keep using the plain module
        net = torch.compile(net, mode="reduce-overhead" if graphs else None)

    def autocast():
        if device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def checkpoint(reason):
        states = [batches.state()]
        if world > 1:  # every rank's data position, so that each resumes its own stream (a collective)
            import torch.distributed as dist
            states = [None] * world
            dist.all_gather_object(states, batches.state())
        model_state, optim_state = _full_states(model, optim, fsdp)  # a collective under FSDP
        if rank != 0:
            return
        out.mkdir(parents=True, exist_ok=True)
        save_atomic({"model": model_state, "optim": optim_state, "step": step,
                     "model_cfg": asdict(mcfg), "train_cfg": asdict(tcfg), "preset": preset_name,
                     "rng": torch.get_rng_state(), "data_state": states, "history": history}, ckpt_path)
        with open(out / "history.json", "w") as f:
            json.dump(history, f)
        log(f"checkpoint ({reason}) at step {step} -> {ckpt_path}")

    tokens_per_step = tcfg.batch_size * mcfg.seq_len
    flops_per_step = model.flops_per_token() * tokens_per_step
    if rank == 0:
        log(f"{preset_name}: {model.num_params() / 1e6:.2f}M parameters, {tokens_per_step} tokens/step, "
            f"device {device}, {world} process(es)")
    profiler = StepProfiler(rank == 0)  # WARPFORGE_PROFILE_STEPS=A:B: wall vs kernel time of those steps
    start_wall = time.time()
    bar = _progress(tcfg.max_steps, step, rank == 0)
    last_t, last_step = time.time(), step
    try:
        while step < tcfg.max_steps:
            if stop_at_step is not None and step >= stop_at_step:
                break
            if tcfg.max_minutes is not None and time.time() - start_wall > 60 * tcfg.max_minutes:
                log(f"time limit of {tcfg.max_minutes} min reached")
                break
            for g in optim.param_groups:
                g["lr"] = lr_at(step, tcfg)
            x, y = batches.next(device)
            if graphs:
                torch.compiler.cudagraph_mark_step_begin()
            with autocast():
                loss = net(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg.grad_clip)
            optim.step()
            optim.zero_grad(set_to_none=True)
            step += 1
            profiler.after_step(step, log)
            if step % 10 == 0 or step == tcfg.max_steps:
                lval = loss.item()
                now = time.time()
                tps = tokens_per_step * (step - last_step) / max(now - last_t, 1e-9)
                last_t, last_step = now, step
                # per GPU: tps counts the global batch, which `world` GPUs share
                mfu = flops_per_step / tokens_per_step * tps / (world * PEAK_BF16) if device.type == "cuda" else None
                history.append({"step": step, "loss": lval, "tokens_per_s": tps, "mfu": mfu,
                                "elapsed_s": now - start_wall})
                bar.update(step, f"loss {lval:.3f} | {tps:,.0f} tok/s" + (f" | MFU {100 * mfu:.1f}%" if mfu else ""))
            if val_data is not None and (step % tcfg.eval_every == 0 or step == tcfg.max_steps) and \
                    (rank == 0 or fsdp):  # FSDP: every rank takes part in the forward's all-gathers
                v = evaluate(model, val_data, tcfg, device, autocast)
                history.append({"step": step, "val_loss": v, "elapsed_s": time.time() - start_wall})
                if rank == 0:
                    log(f"step {step}: val {v:.3f} nats/byte")
            if step % tcfg.ckpt_every == 0:
                checkpoint("periodic")
    except KeyboardInterrupt:
        log("interrupted")
        checkpoint("interrupt")
        raise
    finally:
        bar.close()
    if val_data is not None and (rank == 0 or fsdp) and \
            not any(h.get("step") == step and "val_loss" in h for h in history):
        history.append({"step": step, "val_loss": evaluate(model, val_data, tcfg, device, autocast),
                        "elapsed_s": time.time() - start_wall})
        if rank == 0:
            log(f"step {step}: val {history[-1]['val_loss']:.3f} nats/byte")
    checkpoint("end")
    return {"step": step, "history": history, "out": str(out), "params": model.num_params()}


def _shard(model: GPT) -> None:
    """FSDP2: each block its own unit (its parameters gathered for its forward and backward, then freed), the
    embedding, final norm and (tied) head in the root's."""
    from torch.distributed.fsdp import fully_shard
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)


def _full_states(model, optim, fsdp: bool):
    """(model, optimizer) state dicts; under FSDP full and on the CPU, gathered from every rank (a collective),
    so the weights read the same whatever wrote them (the optimizer state is keyed by parameter name there)."""
    if not fsdp:
        return model.state_dict(), optim.state_dict()
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=opts), get_optimizer_state_dict(model, optim, options=opts)


def _load_optimizer(model, optim, state, fsdp: bool, ckpt_path) -> None:
    try:
        if fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
            set_optimizer_state_dict(model, optim, state, options=StateDictOptions(full_state_dict=True))
        else:
            optim.load_state_dict(state)
    except (KeyError, ValueError, RuntimeError) as exc:
        raise TrainError(f"{ckpt_path}: its optimizer state does not load here ({type(exc).__name__}); resume "
                         f"with the --parallel it was written with") from None


class _progress:
    """tqdm when it is installed, else a line every 10%."""

    def __init__(self, total, start, enabled):
        self.total, self.enabled, self.bar = total, enabled, None
        self.next_print = start
        if enabled:
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
        elif step >= self.next_print:
            print(f"step {step}/{self.total} | {text}", flush=True)
            self.next_print = step + max(1, self.total // 10)

    def close(self):
        if self.bar is not None:
            self.bar.close()
