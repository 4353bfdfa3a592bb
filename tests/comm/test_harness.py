"""The multi-process harness itself: results by rank, child tracebacks, ranks that die; the pool of
persistent ranks (independent process groups, restored state, replaced ranks)."""
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


@pytest.mark.parametrize("fresh", [False, True], ids=["pool", "fresh"])
def test_failing_and_vanishing_ranks_are_reported_with_tracebacks(fresh):
    before = None if fresh else run_workers(2, _whoami)
    with pytest.raises(WorkerError) as info:
        run_workers(2, _rank_zero_raises_rank_one_exits, timeout=60, fresh=fresh)
    text = str(info.value)
    assert "rank(s) [0, 1]" in text
    assert "Traceback" in text and "boom from rank zero" in text
    assert "rank 1 exited with code 3 without reporting" in text
    if not fresh:  # the pool replaced both ranks of the failed call; the next call works
        after = run_workers(2, _whoami)
        assert {r["pid"] for r in after}.isdisjoint(r["pid"] for r in before)
        assert [r["groups"] for r in after] == [1, 1] and [r["mark"] for r in after] == [False, False]


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


# --------------------------------------------------------------------------- the pool of persistent ranks

def _whoami(rank, world_size):
    """Process, group and state facts a call sees on entry."""
    import torch
    import torch.distributed as dist

    from lightning_optim.comm import collective_timeout, comm_stats

    store = dist.distributed_c10d._get_default_store()
    mark = f"left-by-rank-{rank}"  # only this rank sets it: seen on entry means an earlier call's store
    seen_mark = store.check([mark])
    store.set(mark, "yes")
    groups = len(dist.distributed_c10d._world.pg_map)
    dist.new_group(list(range(world_size)))  # left for the harness to tear down
    return dict(pid=os.getpid(), mark=seen_mark, groups=groups, env=os.environ.get("LO_HARNESS_PROBE"),
                dtype=torch.get_default_dtype(), grad=torch.is_grad_enabled(), threads=torch.get_num_threads(),
                bound=collective_timeout(), seed=torch.initial_seed(), cwd=os.getcwd(),
                sent=comm_stats().bytes_sent)


def _dirty_everything(rank, world_size, tmp):
    import torch

    from lightning_optim.comm import allreduce_mean, comm_stats, set_collective_timeout

    allreduce_mean(torch.ones(1000))
    assert comm_stats().bytes_sent > 0
    os.environ["LO_HARNESS_PROBE"] = "leaked"
    os.chdir(tmp)
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.set_num_threads(2)
    set_collective_timeout(3.0)
    return os.environ.get("LO_PROBE_ARG")


def _rank_one_sleeps(rank, world_size):
    import time

    if rank == 1:
        time.sleep(600)
    return "done"


def test_two_calls_get_independent_process_groups_on_the_same_ranks():
    first, second = run_workers(2, _whoami), run_workers(2, _whoami)
    assert [r["pid"] for r in first] == [r["pid"] for r in second]  # the pool kept its ranks
    for run in (first, second):
        assert [r["mark"] for r in run] == [False, False]  # a new store: nothing from the call before
        assert [r["groups"] for r in run] == [1, 1]  # the earlier call's sub-group is gone
    seeds = {r["seed"] for r in first + second}
    assert len(seeds) == 4  # every rank of every call freshly seeded, as a fresh process is


def test_process_state_is_restored_after_a_call(tmp_path):
    import torch

    from lightning_optim.comm.timeouts import DEFAULT_COLLECTIVE_TIMEOUT_S

    before = run_workers(2, _whoami)
    assert run_workers(2, _dirty_everything, str(tmp_path), env={"LO_PROBE_ARG": "given"}, fresh=False) == [
        "given", "given"]
    after = run_workers(2, _whoami)
    assert [r["pid"] for r in after] == [r["pid"] for r in before]
    for r in after:
        assert r["env"] is None and r["cwd"] == before[0]["cwd"]
        assert r["dtype"] == torch.float32 and r["grad"] and r["threads"] == 1
        assert r["bound"] == DEFAULT_COLLECTIVE_TIMEOUT_S  # set_collective_timeout's module global restored
        assert r["sent"] == 0  # the process-wide byte counter starts at zero, as in a fresh rank


def test_a_call_sees_the_parents_current_environment_and_cwd(tmp_path, monkeypatch):
    # what a rank spawned at the time of the call would inherit, though the pool's ranks started earlier
    monkeypatch.setenv("LO_HARNESS_PROBE", "set by the test")
    monkeypatch.chdir(tmp_path)
    assert [(r["env"], r["cwd"]) for r in run_workers(2, _whoami)] == [("set by the test", str(tmp_path))] * 2


def test_a_timeout_kills_the_call_and_the_next_call_works():
    before = run_workers(2, _whoami)
    # rank 1 never reports; rank 0 may not have either on a crowded machine (5 s is a bound, not a duration)
    with pytest.raises(TimeoutError, match=r"timed out after 5s; ranks still running: \[(0, )?1\]"):
        run_workers(2, _rank_one_sleeps, timeout=5)
    after = run_workers(2, _whoami)
    assert after[1]["pid"] != before[1]["pid"] and [r["mark"] for r in after] == [False, False]


def test_fresh_calls_get_new_processes():
    pooled = run_workers(2, _whoami)
    fresh = run_workers(2, _whoami, fresh=True)
    assert not {r["pid"] for r in pooled} & {r["pid"] for r in fresh}
    assert [r["threads"] for r in fresh] == [1, 1]


def _imported_at_entry(rank, world_size):
    import sys

    server = os.getppid()
    with open(f"/proc/{server}/stat") as f:
        server_parent = int(f.read().rsplit(")", 1)[1].split()[1])
    return {"lightning": "lightning" in sys.modules, "env": os.environ.get("LO_HARNESS_PROBE"),
            "parent": server, "server_parent": server_parent, "executable": sys.executable}


def test_ranks_fork_from_the_preloaded_server_unless_the_call_sets_environment_variables():
    """Pool and fresh ranks are forked by multiprocessing's fork server, itself forked from tests.cli's zygote
    (which imported Lightning once for both); a call with env= gets new interpreters instead, whose imports all
    happen after the variables are set. Every rank's sys.executable is the real interpreter."""
    import sys

    from tests.cli import zygote_pid

    for forked in (run_workers(2, _imported_at_entry), run_workers(2, _imported_at_entry, fresh=True)):
        assert [(r["lightning"], r["server_parent"]) for r in forked] == [(True, zygote_pid())] * 2
    with_env = run_workers(2, _imported_at_entry, env={"LO_HARNESS_PROBE": "set"})
    assert [(r["lightning"], r["env"]) for r in with_env] == [(False, "set")] * 2
    assert all(r["parent"] == os.getpid() for r in with_env)  # spawned: this process's children
    assert {r["executable"] for r in forked + with_env} == {sys.executable}
