"""`warpforge gpt train` several times in one process, one run after another, each as the command line runs it
(warpforge.cli.main with sys.argv set): the multi-process tests of test_gpt.py start one torchrun launch (or one
plain process) for several runs instead of one each, as process start-up is most of a small run's time.

    python tests/gpt/train_runs.py '[["--preset", "tiny", ...], [...]]'

Each run's arguments follow `warpforge gpt train`. After each run, rank 0 (or the only process) prints MARK and the
run's index on a line of its own, so its output can be split by run; the first run that fails ends the process
with its exit code. Each run makes (and tears down) its own process group, as a fresh launch would; under torchrun,
each run after the first makes it on a store of its own (as a restarted launch would get): a group made again on
the launcher's store would meet the previous group's keys there."""
import json
import os
import sys

MARK = "=== train_runs: finished run"


def _new_store(i: int, launcher: tuple[str, int]) -> None:
    """Run i's process group rendezvous on a new store that rank 0 hosts on a free port, which it tells the other
    ranks through the launcher's store (what warpforge's own controller does for each attempt: a port of its own)."""
    import socket
    from datetime import timedelta

    import torch.distributed as dist
    launcher_store = dist.TCPStore(*launcher, is_master=False, timeout=timedelta(minutes=10))
    key = f"warpforge_train_runs/port/{i}"
    if os.environ["RANK"] == "0":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        launcher_store.set(key, str(port))
    else:
        port = int(launcher_store.get(key))
    os.environ.update(MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="False")


def main() -> int:
    from warpforge.cli import main as warpforge_main
    runs = json.loads(sys.argv[1])
    launcher = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])) if "RANK" in os.environ else None
    for i, args in enumerate(runs):
        if launcher and i:
            _new_store(i, launcher)
        sys.argv = ["warpforge", "gpt", "train", *args]
        rc = warpforge_main()
        sys.stdout.flush()
        if os.environ.get("RANK", "0") == "0":
            print(f"{MARK} {i}", flush=True)
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
