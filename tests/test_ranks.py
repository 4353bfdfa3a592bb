"""The thread tier's own behaviour (tests/ranks.py): failures reported with their rank, per-rank warnings and call
counts, the process left as it was found."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist

from tests.ranks import RankError, counting_calls, record_warnings, run_ranks, seeded


def _rank_one_raises(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("rank one's own failure")
    return rank


def test_a_failing_rank_is_named_with_its_traceback():
    with pytest.raises(RankError, match=r"rank\(s\) \[1\] failed(.|\n)*rank one's own failure"):
        run_ranks(2, _rank_one_raises, timeout=60)


def _warns_its_rank(rank: int, world: int) -> list[str]:
    with record_warnings() as caught:
        dist.barrier()  # both ranks inside their blocks at once
        warnings.warn(f"from rank {rank}")
        dist.barrier()
    return [str(w.message) for w in caught]


def test_each_rank_records_only_its_own_warnings():
    assert run_ranks(3, _warns_its_rank, timeout=60) == [[f"from rank {r}"] for r in range(3)]


def _counts_its_calls(rank: int, world: int) -> int:
    calls = []
    with counting_calls(dist, ["all_reduce"], lambda *_: calls.append(1)):
        dist.barrier()  # not counted
        dist.all_reduce(torch.ones(1))
        if rank == 1:  # rank 1 counts its second call too; rank 0 has stopped counting by then
            dist.all_reduce(torch.ones(1))
    if rank == 0:
        dist.all_reduce(torch.ones(1))
    return len(calls)


def test_counted_calls_are_each_rank_own():
    all_reduce = dist.all_reduce
    assert run_ranks(2, _counts_its_calls, timeout=60) == [1, 2]
    assert dist.all_reduce is all_reduce  # unwrapped when the last rank stops counting


def _sets_the_environment(rank: int, world: int) -> str:
    os.environ["LO_RANKS_PROBE"] = str(rank)
    with seeded(7):
        return repr(torch.rand(3).tolist())


def test_the_environment_is_put_back_and_seeded_draws_agree():
    draws = run_ranks(2, _sets_the_environment, timeout=60)
    assert "LO_RANKS_PROBE" not in os.environ
    assert draws[0] == draws[1]
