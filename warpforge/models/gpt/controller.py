"""Single-controller training on torchmonarch: `warpforge gpt train --controller monarch --procs N`.

One Python process (this one) spawns a torchmonarch process mesh of N trainers on this host. Each trainer is a DDP
rank (gloo on CPU, NCCL on GPU: rank r uses GPU r) running the ordinary training loop (train.train) and sends its
loss after every step; the controller prints the mean over the ranks. When a trainer process dies, the controller
stops the mesh, spawns a new one and resumes from the last checkpoint (rank 0 writes it), up to `max_restarts`
times, without the user running anything again. torchmonarch is an optional extra: pip install -e '.[monarch]'.

Events from the mesh (losses, each rank's end, process deaths) arrive on one queue, so the controller reads them in
order and Ctrl-C reaches it at once (the mesh is then stopped; the last checkpoint stays).
"""
from __future__ import annotations

import importlib
import logging
import queue
import socket
import threading
import time
from pathlib import Path

from .checkpoint import TrainError, read_checkpoint
from .train import _Progress, resolve_run

__all__ = ["train_with_controller", "monarch_missing", "MonarchMissing", "INSTALL_HINT"]

log = logging.getLogger(__name__)

INSTALL_HINT = "--controller monarch needs torchmonarch: pip install -e '.[monarch]' (or pip install torchmonarch)"
ERROR_WAIT_S = 60.0  # after a rank fails (a collective broken by a dead peer), how long to wait for the death
STOP_WAIT_S = 60.0   # for a stopped mesh's processes to end


class MonarchMissing(TrainError):
    """torchmonarch is not installed or does not import here (the message says how to install it)."""


def monarch_missing() -> str | None:
    """None when torchmonarch imports; else a one-line reason with the install command."""
    try:
        importlib.import_module("monarch.actor")
    except Exception as exc:  # noqa: BLE001 (ImportError, or a binary that does not load here)
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        return f"{INSTALL_HINT} ({first})" if not isinstance(exc, ModuleNotFoundError) else INSTALL_HINT
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ckpt_step(path: Path) -> int | None:
    if not path.exists():
        return None
    try:
        return int(read_checkpoint(path)["step"])
    except TrainError:
        return None


class _Attempt:
    """One mesh of trainers: spawned, its endpoint called, its events forwarded to the controller's queue."""

    def __init__(self, n: int, procs: int, job: dict, events: queue.Queue):
        from monarch.actor import Channel, this_host

        from .monarch_worker import TrainerActor
        self.n, self.name = n, f"trainer{n}"
        self.mesh = this_host().spawn_procs({"procs": procs})
        actors = self.mesh.spawn(self.name, TrainerActor)
        port, receiver = Channel.open()
        call = actors.train.call(port, dict(job, attempt=n))

        def forward_messages():
            while True:
                try:
                    events.put(receiver.recv().get())
                except Exception:  # noqa: BLE001 (the channel closed with the controller)
                    return

        def watch_call():  # the call ends when every rank returned, or fails when a process died
            try:
                call.get()
            except Exception as exc:  # noqa: BLE001
                events.put(("died", n, " ".join(str(exc).split())))

        for fn in (forward_messages, watch_call):
            threading.Thread(target=fn, daemon=True, name=f"warpforge-{self.name}-{fn.__name__}").start()

    def owns(self, failure) -> bool:
        name = str(getattr(failure, "mesh_name", ""))
        return name == self.name or name.startswith(self.name + "-")

    def stop(self) -> None:
        try:
            self.mesh.stop().get(timeout=STOP_WAIT_S)
        except Exception as exc:  # noqa: BLE001 (already gone, or slow to go: nothing more to do here)
            log.debug(f"stopping {self.name}: {exc}")


def train_with_controller(preset_name: str, out_dir: str | None = None, resume: bool = False, *, procs: int = 2,
                          max_restarts: int = 3, fail_at: tuple[int, int] | None = None, progress_bar: bool = False,
                          **overrides) -> dict:
    """train.train's run over a torchmonarch mesh of `procs` trainer processes (DDP), restarted from the last
    checkpoint when one dies (at most max_restarts times). Returns rank 0's result (see train.train) with
    "losses" {step: mean loss over the ranks}, "restarts" and "procs". fail_at (rank, step): that rank's process
    exits after that step, in the first mesh only (tests)."""
    problem = monarch_missing()
    if problem:
        raise MonarchMissing(problem)
    import torch
    run = resolve_run(preset_name, out_dir, resume, **overrides)  # every setting checked here, before any spawn
    if not (isinstance(procs, int) and procs >= 1):
        raise TrainError(f"procs: expected a positive integer, got {procs!r}")
    if run.train_cfg.batch_size % procs:
        raise TrainError(f"batch size {run.train_cfg.batch_size} does not split over {procs} processes")
    if torch.cuda.is_available() and procs > torch.cuda.device_count():
        raise TrainError(f"procs: {procs} trainers need {procs} GPUs, found {torch.cuda.device_count()}")
    if max_restarts < 0:
        raise TrainError(f"max_restarts: expected an integer >= 0, got {max_restarts!r}")

    import monarch.actor as monarch_actor
    events: queue.Queue = queue.Queue()
    current: list[_Attempt] = []

    def on_fault(failure) -> None:  # the root client's unhandled supervision events: handled here (no exit)
        owner = next((a for a in current if a.owns(failure)), None)
        if owner is not None:
            events.put(("died", owner.n, " ".join(str(failure).split())))

    previous_hook = monarch_actor.unhandled_fault_hook
    monarch_actor.unhandled_fault_hook = on_fault
    start_step = run.ckpt["step"] if run.ckpt else 0
    bar = _Progress(run.train_cfg.max_steps, start_step, True, progress_bar)
    losses: dict[int, float] = {}
    job = {"preset": preset_name, "out": str(run.out), "world": procs, "master_addr": "127.0.0.1",
           "overrides": overrides, "fail_at": fail_at}
    log.info(f"controller: {procs} trainer process(es) on a torchmonarch mesh, run {run.out}")
    restarts, resume_now, attempt = 0, resume, None
    try:
        while True:
            attempt = _Attempt(restarts, procs, dict(job, resume=resume_now, master_port=_free_port()), events)
            current.append(attempt)
            outcome, detail = _follow(attempt, procs, events, losses, bar)
            attempt.stop()
            if outcome == "done":
                result = dict(detail, losses=losses, restarts=restarts, procs=procs)
                return result
            if outcome == "error":
                raise TrainError(f"a trainer failed: {detail}")
            step = _ckpt_step(run.ckpt_path)
            if restarts >= max_restarts:
                again = f"; --resume continues from step {step}" if step is not None else ""
                raise TrainError(f"a trainer process died {restarts + 1} time(s), more than --max-restarts "
                                 f"{max_restarts} allows (last: {detail[:300]}){again}")
            restarts += 1
            resume_now = step is not None
            where = f"the checkpoint at step {step}" if step is not None else "step 0 (no checkpoint yet)"
            log.warning(f"controller: a trainer process died ({detail[:300]}); restarting the mesh from {where} "
                        f"(restart {restarts} of at most {max_restarts})")
            job["fail_at"] = None  # an injected failure happens once
    finally:
        if attempt is not None:
            attempt.stop()
        bar.close()
        monarch_actor.unhandled_fault_hook = previous_hook


def _follow(attempt: _Attempt, procs: int, events: queue.Queue, losses: dict, bar: _Progress):
    """Reads the attempt's events until it ends: ("done", rank 0's result), ("died", why) or ("error", why)."""
    per_step: dict[int, dict[int, float]] = {}
    done: dict[int, dict] = {}
    errors: dict[int, str] = {}
    error_deadline = None
    while True:
        try:
            ev = events.get(timeout=0.5)
        except queue.Empty:
            ev = None
        if ev is not None and ev[1] == attempt.n:  # events of earlier meshes are stale
            kind = ev[0]
            if kind == "step":
                _, _, rank, step, loss = ev
                got = per_step.setdefault(step, {})
                got[rank] = loss
                if len(got) == procs:
                    losses[step] = sum(got.values()) / procs
                    del per_step[step]
                    bar.update(step, f"loss {losses[step]:.4f}")
            elif kind == "done":
                done[ev[2]] = ev[3]
            elif kind == "error":
                errors[ev[2]] = ev[3]
                error_deadline = error_deadline or time.time() + ERROR_WAIT_S
            elif kind == "died":
                return "died", ev[2]
        if len(done) + len(errors) == procs:  # every rank has ended, none died
            if errors:
                rank = min(errors)
                return "error", f"rank {rank}: {errors[rank]}"
            return "done", done[0]
        if error_deadline is not None and time.time() > error_deadline:  # a rank failed, another hangs
            rank = min(errors)
            return "error", f"rank {rank}: {errors[rank]}"
