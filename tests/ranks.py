"""Ranks as threads of the test process, over real gloo: the harness of the algorithm tests.

``run_ranks(world, fn, *args)`` runs ``fn(rank, world, *args)`` on ``world`` threads, each the rank of one gloo
process group (``init_process_group("gloo", store=...)`` on a ``HashStore`` of its own per call), and returns the
results in rank order. torch's own multi-threaded tests work the same way: ``ThreadLocalWorld`` gives every thread
its own default group (so ``dist.get_rank()``, ``new_group`` and a ``DeviceMesh`` are the thread's rank's), and
thread isolation keeps the C++ registry of group names per thread.

Per rank thread, the library's byte counter (``comm_stats()``) and the global RNG are the rank's own where a test
asks: ``seeded(seed)`` builds a model from a seed without another rank's draws in between.

What threads cannot be, stays in real processes (``tests/processes.py``): a rank that dies or hangs on purpose, a
rank's own environment variables, bytes read off a process's sockets, Lightning's and Accelerate's process-wide
rank state.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import threading
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.testing._internal.distributed import multi_threaded_pg

from lightning_optim.comm import stats as comm_stats_module

_CALLS = itertools.count()
_RNG = threading.Lock()


class RankError(AssertionError):
    """One or more ranks raised; the message holds every failed rank's traceback."""


@contextlib.contextmanager
def seeded(seed: int):
    """The global RNG seeded with ``seed`` for this block, with no other rank thread drawing from it meanwhile."""
    with _RNG, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def run_ranks(world: int, fn, *args, timeout: float = 120.0, pg_timeout: float | None = None) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks (threads of this process); results by rank."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    pg_timeout = float(timeout if pg_timeout is None else pg_timeout)
    store = dist.PrefixStore(f"run_ranks/{next(_CALLS)}", dist.HashStore())
    results: list = [None] * world
    errors: dict[int, str] = {}
    reported = threading.Barrier(world)

    def rank_main(rank: int) -> None:
        try:
            dist.init_process_group("gloo", rank=rank, world_size=world, store=store,
                                    timeout=timedelta(seconds=pg_timeout))
            with comm_stats_module.counting_for_this_thread():
                results[rank] = fn(rank, world, *args)
        except BaseException:  # noqa: BLE001 - everything goes back to the caller
            errors[rank] = traceback.format_exc()
        try:
            reported.wait(pg_timeout)  # no rank leaves the group while another still uses it
        except threading.BrokenBarrierError:
            pass
        with contextlib.suppress(Exception):
            if dist.is_initialized():
                dist.destroy_process_group()

    multi_threaded_pg._install_threaded_pg()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    threads = [threading.Thread(target=rank_main, args=(rank,), name=f"rank{rank}", daemon=True)
               for rank in range(world)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout)
    finally:
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        multi_threaded_pg._uninstall_threaded_pg()
    hung = [t.name for t in threads if t.is_alive()]
    if hung:
        frames = sys._current_frames()
        where = "".join(f"\n--- {t.name} ---\n" + "".join(traceback.format_stack(frames[t.ident]))
                        for t in threads if t.is_alive() and t.ident in frames)
        raise RankError(f"run_ranks({fn.__name__}): {hung} still running after {timeout:.0f} s:{where}")
    if errors:
        detail = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        raise RankError(f"run_ranks({fn.__name__}): rank(s) {sorted(errors)} failed:{detail}")
    return results
