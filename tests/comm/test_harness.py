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
