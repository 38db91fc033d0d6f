"""The 2-rank harness of the distributed tests: which aborts of a rank fail a test."""

import atexit
import os

import pytest
import torch.multiprocessing as mp

from tests.distributed import spawn


def _abort_in_the_worker(rank: int) -> None:
    if rank == 1:
        os.abort()


def _abort_at_exit(rank: int) -> None:
    # After the worker, the final barrier and the group's teardown: as gloo's aborts came.
    if rank == 1:
        atexit.register(os.abort)


def test_an_abort_while_working_fails():
    with pytest.raises(mp.ProcessExitedException, match="SIGABRT"):
        spawn(_abort_in_the_worker)


def test_an_abort_after_every_rank_finished_its_work_does_not_fail():
    spawn(_abort_at_exit)
