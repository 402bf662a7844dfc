"""The trainer actor of the torchmonarch controller (controller.py): one per process of the mesh, each a DDP rank
running the ordinary training loop (train.train), its losses sent to the controller after every step. Imported
only where torchmonarch is installed (controller.py imports it when a run starts)."""
from __future__ import annotations

import os

from monarch.actor import Actor, current_rank, endpoint


class TrainerActor(Actor):
    """Sends ("step", attempt, rank, step, loss) per step, then ("done", attempt, rank, result) or ("error",
    attempt, rank, message) on the port the controller passes."""

    @endpoint
    def train(self, port, job: dict) -> None:
        rank = current_rank().rank
        attempt, world = job["attempt"], job["world"]
        # what torchrun would set: train._distributed makes the process group from these
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                          MASTER_ADDR=job["master_addr"], MASTER_PORT=str(job["master_port"]))
        fail_at = job.get("fail_at")  # (rank, step): this process exits there (tests of the restart)

        def on_step(step, loss):
            port.send(("step", attempt, rank, step, float(loss.item())))
            if fail_at is not None and tuple(fail_at) == (rank, step):
                os._exit(17)

        from .train import train
        try:
            result = train(job["preset"], job["out"], job["resume"], on_step=on_step, **job["overrides"])
        except BaseException as exc:  # noqa: BLE001 (sent to the controller, which decides; the mesh is stopped)
            text = " ".join(str(exc).split())[:500]
            port.send(("error", attempt, rank, f"{type(exc).__name__}: {text}" if text else type(exc).__name__))
            return
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
        port.send(("done", attempt, rank, result))
