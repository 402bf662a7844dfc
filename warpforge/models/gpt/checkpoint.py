"""Checkpoints of a GPT run: one file, ckpt.pt, written atomically, holding the full (unsharded) weights and
optimizer state, the RNG state, every rank's data position, the configs and the history, all as of the end of
one step (tensors and plain values only: it loads with torch.load(..., weights_only=True)). Beside it, the weights
in the standard form other tools read: model.safetensors (each tied tensor once) and config.json (the model config,
the preset, the step and which names are tied). `read_checkpoint` and `read_exported` turn a missing, truncated or
foreign file into a one-line CheckpointError."""
from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

log = logging.getLogger(__name__)

KEYS = ("model", "optim", "step", "model_cfg", "train_cfg", "rng", "data_state", "history")
WEIGHTS, CONFIG = "model.safetensors", "config.json"


class TrainError(RuntimeError):
    """A one-line, user-facing reason a run cannot start (nothing has been written)."""


class CheckpointError(TrainError):
    """A checkpoint that cannot be read, or does not fit what it is loaded into."""


def save_atomic(obj, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)  # a crash mid-write never leaves a torn checkpoint


def check_writable(path: Path) -> None:
    """That a file can be written at path: its directory is made (as a save would make it) and takes a new file,
    and path is not a directory. An OSError now, rather than when the first file is written after minutes of
    work."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory")
    with tempfile.TemporaryFile(dir=path.parent):
        pass


def read_checkpoint(path: Path, keys=KEYS) -> dict:
    """The checkpoint at path (tensors on the CPU), with at least `keys`; else a CheckpointError."""
    path = Path(path)
    try:  # weights_only: a checkpoint is tensors and plain values, and unpickling nothing else runs no code
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint at {path}") from None
    except Exception as exc:  # noqa: BLE001 (torch raises many kinds for a truncated or foreign file)
        raise CheckpointError(f"{path} is not a readable checkpoint (truncated or corrupt?): {_first(exc)}") \
            from None
    missing = [k for k in keys if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise CheckpointError(f"{path} is not a warpforge GPT checkpoint (it lacks {', '.join(missing)})")
    return ckpt


class Checkpointer:
    """Saves a run's state to out/ckpt.pt (and its history to history.json) and restores it. Every rank calls
    save (the data positions and, under FSDP, the weights are gathered); rank 0 writes."""

    def __init__(self, out: Path, preset: str, model_cfg, train_cfg, model, optim, batches, *, rank: int = 0,
                 world: int = 1, fsdp: bool = False, experts: list[str] = ()):
        self.out, self.path = Path(out), Path(out) / "ckpt.pt"
        self.meta = {"model_cfg": asdict(model_cfg), "train_cfg": asdict(train_cfg), "preset": preset}
        self.model, self.optim, self.batches = model, optim, batches
        self.rank, self.world, self.fsdp = rank, world, fsdp
        self.experts = list(experts)  # expert parallelism's sharded parameters: gathered to full ones on save

    def save(self, step: int, history: list, reason: str) -> None:
        states = [self.batches.state()]
        if self.world > 1:  # every rank's data position, so that each resumes its own stream (a collective)
            import torch.distributed as dist
            states = [None] * self.world
            dist.all_gather_object(states, self.batches.state())
        # a collective under FSDP and expert parallelism
        model_state, optim_state = _full_states(self.model, self.optim, self.fsdp, self.experts)
        if self.rank != 0:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        save_atomic({"model": model_state, "optim": optim_state, "step": step, **self.meta,
                     "rng": torch.get_rng_state(), "data_state": states, "history": history}, self.path)
        export_weights(self.out, model_state, self.meta["model_cfg"], self.meta["preset"], step)
        with open(self.out / "history.json", "w") as f:
            json.dump(history, f)
        log.info(f"checkpoint ({reason}) at step {step} -> {self.path}")

    def restore(self, ckpt: dict) -> tuple[int, list]:
        """Optimizer, data position and RNG from ckpt (the weights were loaded before any sharding); returns
        (step, history)."""
        _load_optimizer(self.model, self.optim, ckpt["optim"], self.fsdp, self.path, self.experts)
        if len(ckpt["data_state"]) != self.world:
            raise CheckpointError(f"{self.path} was written by {len(ckpt['data_state'])} process(es), "
                                  f"not {self.world}")
        self.batches.restore(ckpt["data_state"][self.rank])
        torch.set_rng_state(ckpt["rng"])
        log.info(f"resumed {self.path} at step {ckpt['step']}")
        return ckpt["step"], ckpt["history"]


def export_weights(out: Path, state: dict, model_cfg: dict, preset: str, step: int) -> None:
    """out/model.safetensors and out/config.json, each written atomically. safetensors stores no aliases, so a tied
    tensor (the output head sharing the embedding) is stored once and named in config.json's "tied"."""
    from safetensors.torch import save_file
    tensors, tied, first = {}, {}, {}
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        if key in first:
            tied[name] = first[key]
            continue
        first[key] = name
        tensors[name] = t.detach().to("cpu").contiguous()
    tmp = out / (WEIGHTS + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / WEIGHTS)
    tmp = out / (CONFIG + ".tmp")
    tmp.write_text(json.dumps({"model_cfg": model_cfg, "preset": preset, "step": step, "tied": tied}, indent=1))
    os.replace(tmp, out / CONFIG)


def read_exported(folder: Path) -> tuple[dict, dict]:
    """(model_cfg dict, weights with the tied names filled in) from a folder export_weights wrote."""
    folder = Path(folder)
    try:
        meta = json.loads((folder / CONFIG).read_text())
        from safetensors.torch import load_file
        weights = load_file(str(folder / WEIGHTS))
        for name, source in meta.get("tied", {}).items():
            weights[name] = weights[source]
        return meta["model_cfg"], weights
    except FileNotFoundError as exc:
        raise CheckpointError(f"{folder} holds no {Path(exc.filename).name}") from None
    except Exception as exc:  # noqa: BLE001 (a torn or foreign file: json, safetensors and key errors)
        raise CheckpointError(f"{folder}: not a readable warpforge export ({_first(exc)})") from None


def load_weights(model, state: dict, path: Path) -> None:
    try:
        model.load_state_dict(state)
    except (KeyError, RuntimeError) as exc:
        raise CheckpointError(f"{path}: its weights do not fit the model ({_first(exc)})") from None


def _first(exc: Exception) -> str:
    """An exception's first sentence, for a one-line message."""
    text = " ".join(str(exc).split())
    return text.split(". ")[0][:200] if text else type(exc).__name__


def _full_states(model, optim, fsdp: bool, experts: list[str] = ()):
    """(model, optimizer) state dicts; under FSDP full and on the CPU, gathered from every rank (a collective),
    so the weights read the same whatever wrote them (the optimizer state is keyed by parameter name there); under
    expert parallelism with every expert's weights and state gathered (a collective)."""
    if experts:
        from .experts import full_states
        return full_states(model, optim, experts)
    if not fsdp:
        return model.state_dict(), optim.state_dict()
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=opts), get_optimizer_state_dict(model, optim, options=opts)


def _load_optimizer(model, optim, state, fsdp: bool, ckpt_path, experts: list[str] = ()) -> None:
    try:
        if experts:
            from .experts import local_optim_state
            _load_own_flags(optim, local_optim_state(model, state, experts))
        elif fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
            set_optimizer_state_dict(model, optim, state, options=StateDictOptions(full_state_dict=True))
        else:
            _load_own_flags(optim, state)
    except (KeyError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{ckpt_path}: its optimizer state does not load here ({type(exc).__name__}); resume "
                              f"with the --parallel it was written with") from None


def _load_own_flags(optim, state: dict) -> None:
    """optim.load_state_dict(state), keeping optim's implementation flags (fused, foreach, capturable): a state
    written under another mode (ZeRO-2's optimizer, a CPU run) says how its writer ran, not how this one should. A
    fused or capturable AdamW wants its step counters on the parameters' device."""
    flags = ("fused", "foreach", "capturable", "differentiable")
    own = [{k: g[k] for k in flags if k in g} for g in optim.param_groups]
    optim.load_state_dict(state)
    for g, mine in zip(optim.param_groups, own):
        g.update(mine)
        if g.get("fused") or g.get("capturable"):
            for p in g["params"]:
                st = optim.state.get(p, {})
                if isinstance(st.get("step"), torch.Tensor):
                    st["step"] = st["step"].to(device=p.device, dtype=torch.float32)

