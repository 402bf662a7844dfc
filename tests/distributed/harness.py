"""Run a function on N CPU processes joined by gloo (or N GPUs joined by NCCL), and bring back what each returned.

`run_ranks(fn, world, *args)` spawns `world` processes; each joins one gloo group, calls fn(rank, world, *args)
and sends its return value (anything picklable; tensors are moved to the CPU) back. fn must be a module-level
function (the children import it by name). A child that raises fails the caller with the child's traceback."""
from __future__ import annotations

import io
import os
import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank, world, port, fn, args, results, backend):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # CI has two cores for every rank
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        out = fn(rank, world, *args)
        # as bytes: a tensor put on the queue itself travels as shared memory that dies with this process
        buf = io.BytesIO()
        torch.save(_cpu(out), buf)
        results.put((rank, buf.getvalue(), None))
    except BaseException:  # noqa: BLE001 - the parent re-raises it
        results.put((rank, None, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def _cpu(x):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, (list, tuple)):
        return type(x)(_cpu(v) for v in x)
    if isinstance(x, dict):
        return {k: _cpu(v) for k, v in x.items()}
    return x


def run_ranks(fn, world: int, *args, timeout: float = 600.0, backend: str = "gloo") -> list:
    """[fn's return value on rank 0, ..., on rank world - 1]. backend "nccl": rank r on GPU r."""
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, world, port, fn, args, results, backend), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < world:
            if results.empty():
                dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode not in (None, 0)]
                if dead and results.empty():  # a child that died without a word (a crash, a kill)
                    raise RuntimeError(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks {sorted(set(range(world)) - set(got))} did not finish in {timeout} s")
                time.sleep(0.02)
                continue
            rank, out, err = results.get()
            if err is not None:
                raise RuntimeError(f"rank {rank} failed:\n{err}")
            got[rank] = torch.load(io.BytesIO(out), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=timeout)
            if p.is_alive():
                p.kill()
    return [got[r] for r in range(world)]
