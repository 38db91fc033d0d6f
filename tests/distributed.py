"""Running a test's worker on 2 CPU ranks over gloo (the distributed tests share this)."""

import faulthandler
import os
import signal
import socket
import tempfile
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

WORLD_SIZE = 2


def spawn(worker, *args) -> None:  # noqa: ANN001
    """Run `worker(rank, *args)` on WORLD_SIZE processes, each in a gloo process group.

    A rank that the C++ runtime aborts after its worker returned and every rank met at the
    final barrier ("terminate called without an active exception": gloo tearing down while
    its peer exits, seen on loaded CI machines) has done all its work, which the tests
    check on disk, so that abort is not a failure. An abort before that point still is."""
    with tempfile.TemporaryDirectory() as marks:
        try:
            mp.spawn(_run, args=(_free_port(), marks, worker, args), nprocs=WORLD_SIZE)
        except mp.ProcessExitedException as error:
            done = all((Path(marks) / str(rank)).exists() for rank in range(WORLD_SIZE))
            if not (done and error.signal_name == "SIGABRT"):
                raise


def _run(rank: int, port: int, marks: str, worker, args: tuple) -> None:  # noqa: ANN001
    # A hung rank prints every thread's stack on SIGUSR1 (`pkill -USR1 -f spawn_main`).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    try:
        worker(rank, *args)
        # No collective in flight at teardown: gloo has aborted the process when one rank
        # destroyed its group while the other still had work queued.
        dist.barrier()
        (Path(marks) / str(rank)).touch()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
