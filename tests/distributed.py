"""Running a test's worker on 2 CPU ranks over gloo (the distributed tests share this)."""

import faulthandler
import os
import signal
import socket

import torch.distributed as dist
import torch.multiprocessing as mp

WORLD_SIZE = 2


def spawn(worker, *args) -> None:  # noqa: ANN001
    """Run `worker(rank, *args)` on WORLD_SIZE processes, each in a gloo process group."""
    mp.spawn(_run, args=(_free_port(), worker, args), nprocs=WORLD_SIZE)


def _run(rank: int, port: int, worker, args: tuple) -> None:  # noqa: ANN001
    # A hung rank prints every thread's stack on SIGUSR1 (`pkill -USR1 -f spawn_main`).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    try:
        worker(rank, *args)
        # No collective in flight at teardown: gloo has aborted the process ("terminate called
        # without an active exception") when one rank destroyed its group while the other
        # still had work queued.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
