"""The multi-process harness itself: results by rank, child tracebacks, ranks that die."""
from __future__ import annotations

import os

import pytest

from tests.distributed import WorkerError, run_workers


def _rank_zero_raises_rank_one_exits(rank, world_size):
    if rank == 0:
        raise KeyError("boom from rank zero")
    os._exit(3)


def test_results_ordered_by_rank(comm_spawn):
    # the shared 4-rank spawn (conftest.py) also reports who it was
    assert [r["whoami"]["rank"] for r in comm_spawn] == [0, 1, 2, 3]
    assert all(r["whoami"]["world"] == 4 and r["whoami"]["threads"] == 1 for r in comm_spawn)


def test_failing_and_vanishing_ranks_are_reported_with_tracebacks():
    with pytest.raises(WorkerError) as info:
        run_workers(2, _rank_zero_raises_rank_one_exits, timeout=60)
    text = str(info.value)
    assert "rank(s) [0, 1]" in text
    assert "Traceback" in text and "boom from rank zero" in text
    assert "rank 1 exited with code 3 without reporting" in text


def _rank_zero_leaves_early(rank, world_size):
    """Rank 0 (the host of the rendezvous store) is done at once; the others then still need the store
    to build a subgroup among themselves (as a gossip subgroup that leaves rank 0 out does)."""
    import time

    import torch
    import torch.distributed as dist

    if rank == 0:
        return "left"
    time.sleep(1.0)
    group = dist.new_group(list(range(1, world_size)), use_local_synchronization=True)
    total = torch.ones(1)
    dist.all_reduce(total, group=group)
    return float(total)


def test_no_rank_leaves_before_every_rank_has_reported():
    # rank 0 hosts the TCP store: had it exited after reporting, ranks 1-2 would fail to connect
    # ("Connection closed by peer"), as a gossip test once did under load
    assert run_workers(3, _rank_zero_leaves_early, timeout=60) == ["left", 2.0, 2.0]
