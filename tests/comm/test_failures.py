"""A rank that dies or hangs: the survivor gets a CommunicationError, bounded by the group timeout.

One spawn of 3 ranks: rank 2 dies (``os._exit``) before a collective on the group {0, 2};
rank 1 stays alive but silent through a collective on the group {0, 1}.
"""
from __future__ import annotations

import os
import time
from datetime import timedelta

import torch

from tests.distributed import run_workers

PG_TIMEOUT = 5.0


def _one_dies_one_hangs(rank, world):
    import torch.distributed as dist

    from lightning_optim.comm import allreduce_mean, compressed_allreduce, make_error_buffers
    from tests.comm.workers import timed_outcome

    limit = timedelta(seconds=PG_TIMEOUT)  # sub-groups do not inherit the default group's timeout
    with_hanger = dist.new_group([0, 1], timeout=limit)
    with_dead = dist.new_group([0, 2], timeout=limit)
    x = torch.ones(1000)
    compressed_allreduce(x, *make_error_buffers(x))  # everyone alive: works
    if rank == 2:
        os._exit(0)  # dies without a word
    buffers = make_error_buffers(x, with_hanger)
    if rank == 1:
        time.sleep(PG_TIMEOUT + 1.5)  # alive but never joins rank 0's next collective
        return "slept"
    time.sleep(0.5)  # let rank 2 be gone
    report = {}
    calls = (
        ("dead", lambda: allreduce_mean(torch.ones(10), group=with_dead)),
        ("hung", lambda: compressed_allreduce(x, *buffers, group=with_hanger)),
    )
    for name, call in calls:
        report[name] = timed_outcome(call)
    return report


def test_dead_or_hung_rank_gives_communication_error_within_timeout():
    out = run_workers(3, _one_dies_one_hangs, timeout=60, pg_timeout=PG_TIMEOUT, missing_ok=True)
    assert out[1] == "slept" and out[2] is None  # rank 2 exited on purpose
    report = out[0]
    for name, (message, _) in report.items():
        assert not message.startswith(("no error", "wrong type")), (name, message)
        assert "may have died" in message and "failed after" in message, message
    message, elapsed = report["dead"]
    assert "all_reduce" in message
    assert elapsed < PG_TIMEOUT + 5, elapsed
    message, elapsed = report["hung"]
    assert "all_gather(sizes)" in message and "timeout 5s" in message  # its first collective
    assert PG_TIMEOUT - 1 < elapsed < PG_TIMEOUT + 5, elapsed
