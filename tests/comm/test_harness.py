"""The multi-process harness itself: results by rank, child tracebacks, dead ranks."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tests.distributed import WorkerError, run_workers


def _sum_ranks(rank, world_size, scale):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return {"rank": rank, "world": world_size, "sum": t * scale, "threads": torch.get_num_threads()}


def _raise_on_rank_one(rank, world_size):
    if rank == 1:
        raise KeyError("boom from rank one")
    return rank


def _exit_on_rank_one(rank, world_size):
    if rank == 1:
        os._exit(0)
    return rank


def test_results_ordered_by_rank_and_errors_carry_traceback():
    out = run_workers(3, _sum_ranks, 2.0, timeout=60)
    assert [o["rank"] for o in out] == [0, 1, 2]
    assert all(o["world"] == 3 and o["threads"] == 1 for o in out)
    assert all(torch.equal(o["sum"], torch.tensor([12.0])) for o in out)

    with pytest.raises(WorkerError, match="boom from rank one") as info:
        run_workers(2, _raise_on_rank_one, timeout=60)
    assert "rank(s) [1]" in str(info.value) and "Traceback" in str(info.value)

    assert run_workers(2, _exit_on_rank_one, timeout=60, missing_ok=True) == [0, None]
    with pytest.raises(WorkerError, match="without reporting"):
        run_workers(2, _exit_on_rank_one, timeout=60)
