"""Probe: every collective entry point is bounded by ``collective_timeout()`` even when the process
group has torch's 30-minute default, and ranks that disagree are refused identically everywhere.

Real gloo ranks. Rank 1 creates every sub-group (a collective act) and then never calls; rank 0
calls each entry point on its own sub-group with the bound at 3 s.
"""
from __future__ import annotations

import functools
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lightning_optim.comm import (
    allreduce_mean,
    check_process_group,
    collective_timeout,
    compressed_allreduce,
    gather_rows,
    make_error_buffers,
    set_collective_timeout,
)
from tests.comm.workers import timed_outcome
from tests.distributed import run_workers
from tests.ranks import run_ranks

BOUND_S = 3.0
SLOW = timedelta(minutes=30)  # torch's default: what a user who passes no timeout gets


def _entry_points(group):
    x = torch.randn(100)
    worker, server = make_error_buffers(x, group)
    return {
        "all_gather(sizes)": lambda: compressed_allreduce(x, worker, server, group=group),
        "all_reduce": lambda: allreduce_mean(torch.ones(10), group=group),
        "all_gather(probe)": lambda: gather_rows("all_gather(probe)", [1, 2, 3], group=group),
    }


def _ddp_backward(ddp_group):
    """rank 0's backward through the switchable hook, on a group where rank 1 never runs one."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_optim.comm import register_switchable_allreduce

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 4), process_group=ddp_group)  # both ranks: DDP broadcasts at start
    register_switchable_allreduce(model, group=ddp_group)
    return lambda: model(torch.randn(3, 8)).sum().backward()


def _one_rank_never_calls(rank, world):
    groups = [dist.new_group([0, 1], timeout=SLOW) for _ in range(4)]
    backward = _ddp_backward(groups[3])
    store = dist.distributed_c10d._get_default_store()  # the rendezvous store: no collective, no group
    if rank == 1:
        store.wait(["rank 0 is done"], SLOW)  # alive, never joins: until rank 0 has seen every bound fire
        return None
    try:
        return _bounded_report(backward, groups)
    finally:
        store.set("rank 0 is done", "1")


def _bounded_report(backward, groups):
    """Every entry point on its own group, all at once (one thread each): each must fail within the bound by
    itself, and the test waits one bound instead of four."""
    set_collective_timeout(BOUND_S)
    reports = {name: functools.partial(timed_outcome, _entry_points(group)[name])
               for name, group in zip(_entry_points(None), groups)}
    reports["DDP bucket all_reduce"] = functools.partial(_timed_backward, backward)
    with ThreadPoolExecutor(len(reports)) as pool:
        outcomes = {name: pool.submit(report) for name, report in reports.items()}
    return {name: outcome.result() for name, outcome in outcomes.items()}


def _timed_backward(backward) -> tuple[str, float]:
    start = time.monotonic()
    try:
        backward()
        return "no error", time.monotonic() - start
    except RuntimeError as exc:  # DDP re-raises the hook future's CommunicationError from backward
        return str(exc), time.monotonic() - start


def test_every_entry_point_is_bounded_without_a_group_timeout():
    # fresh ranks: rank 0's collectives time out on purpose, leaving gloo work behind no later call should meet
    out = run_workers(2, _one_rank_never_calls, timeout=120, pg_timeout=SLOW.total_seconds())
    report = out[0]
    assert set(report) == {"all_gather(sizes)", "all_reduce", "all_gather(probe)", "DDP bucket all_reduce"}
    for name, (message, elapsed) in report.items():
        assert not message.startswith(("no error", "wrong type")), (name, message)
        assert name in message and "bound of 3s" in message, message
        assert "set_collective_timeout" in message
        assert BOUND_S - 0.5 < elapsed < BOUND_S + 25, (name, elapsed)


def _mismatch(rank, world, field):
    n, segments, dtype = 64, [30, 34], torch.float32
    if rank == world - 1:
        if field == "numel":
            n, segments = 72, [30, 42]
        elif field == "segment count":
            segments = [30, 20, 14]
        elif field == "segment lengths":
            segments = [34, 30]
        elif field == "dtype":
            dtype = torch.bfloat16
    x = torch.arange(n, dtype=torch.float32).to(dtype)
    worker, server = make_error_buffers(x, None, segments)
    before = (x.clone(), worker.clone(), server.clone())
    try:
        compressed_allreduce(x, worker, server, segments=segments)
        return "no error"
    except ValueError as exc:
        unchanged = all(torch.equal(a, b) for a, b in zip(before, (x, worker, server)))
        return str(exc), unchanged


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("field", ["numel", "segment count", "segment lengths", "dtype"])
def test_ranks_that_disagree_are_refused_identically(world, field):
    out = run_ranks(world, _mismatch, field, timeout=90)
    assert all(o != "no error" for o in out), out
    messages = {o[0] for o in out}
    assert len(messages) == 1, messages  # the same words, with the same figures, on every rank
    assert all(o[1] for o in out)  # nothing changed before the refusal
    message = messages.pop()
    if field == "numel":
        assert f"numel by rank: {[64] * (world - 1) + [72]}" in message
    elif field == "dtype":
        assert f"dtype by rank: {['float32'] * (world - 1) + ['bfloat16']}" in message
    else:
        assert "different segments" in message


def test_timeout_and_group_arguments_are_checked():
    before = collective_timeout()
    for bad in (0, -1.0, float("nan"), float("inf"), timedelta(0)):
        with pytest.raises(ValueError, match=r"seconds.*\(0, inf\)"):
            set_collective_timeout(bad)
    for bad in ("10", None, True):
        with pytest.raises(TypeError, match="seconds"):
            set_collective_timeout(bad)
    assert collective_timeout() == before  # a refused value changes nothing
    for bad in ("x", 3, object()):
        with pytest.raises(TypeError, match=r"process_group must be None.*ProcessGroup"):
            check_process_group("process_group", bad)
    with pytest.raises(TypeError, match="group must be None"):
        allreduce_mean(torch.ones(3), group="x")
