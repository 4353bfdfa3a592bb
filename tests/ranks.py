"""Ranks as threads of the test process, over real gloo: the harness of the algorithm tests.

``run_ranks(world, fn, *args)`` runs ``fn(rank, world, *args)`` on ``world`` threads, each a rank of one gloo group
on a ``HashStore`` of its own per call, and returns the results in rank order. As in torch's own multi-threaded
tests, ``ThreadLocalWorld`` gives every thread its own default group (``dist.get_rank()``, ``new_group`` and a
``DeviceMesh`` are its rank's) and thread isolation keeps C++'s group names per thread. Each rank counts its own
bytes (``comm_stats()``); ``seeded(seed)`` builds a model without another rank's draws in between;
``record_warnings()`` is ``catch_warnings`` for one rank. The library's process-wide state and ``os.environ`` are
put back when the run ends (a variable the ranks read is the test's to set, ``monkeypatch.setenv``). What threads
cannot be stays in processes (``tests/distributed.py``).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import threading
import time
import traceback
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.testing._internal.distributed import multi_threaded_pg

from lightning_optim.comm import stats as comm_stats_module
from tests.library_state import library_globals, restore_library_state

_CALLS = itertools.count()
_RNG = threading.Lock()
_THIS_RANK = threading.local()  # a rank thread's own: .found (its recorded warnings), .counting
_SHOW = warnings.showwarning


class RankError(AssertionError):
    """One or more ranks raised; the message holds every failed rank's traceback."""


@contextlib.contextmanager
def seeded(seed: int):
    """``torch.manual_seed(seed)`` and the block, with no other rank thread drawing from the global RNG meanwhile
    (in one process, as on one rank of several, the RNG goes on from where the block left it)."""
    with _RNG:
        torch.manual_seed(seed)
        yield


@contextlib.contextmanager
def record_warnings():
    """``warnings.catch_warnings(record=True)`` with the "always" filter, for this rank thread alone (``catch_warnings``
    swaps process-wide state: two ranks would record each other's warnings, or lose them)."""
    if warnings.showwarning is not _route:  # not a rank thread (a rank process, a test): the usual way
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield caught
        return
    found: list[warnings.WarningMessage] = []
    _THIS_RANK.found = found
    try:
        yield found
    finally:
        _THIS_RANK.found = None


ignore_warnings = record_warnings  # what a block records and nobody reads is dropped


_WRAPPED: dict[tuple[int, str], list] = {}  # (id(module), name) -> [threads counting, the real function]
_WRAP_LOCK = threading.Lock()


@contextlib.contextmanager
def counting_calls(module, names, count):
    """``count(name, args, kwargs)`` before each call of ``module.<name>`` this thread makes (for several rank
    threads at once: the function is wrapped while any of them counts, and a thread sees only its own calls)."""
    mine: dict = getattr(_THIS_RANK, "counting", None) or {}
    _THIS_RANK.counting = mine
    names = [name for name in names if hasattr(module, name)]
    with _WRAP_LOCK:
        for name in names:
            entry = _WRAPPED.setdefault((id(module), name), [0, getattr(module, name)])
            if entry[0] == 0:
                setattr(module, name, _counted(module, name, entry[1]))
            entry[0] += 1
            mine[(id(module), name)] = count
    try:
        yield
    finally:
        with _WRAP_LOCK:
            for name in names:
                mine.pop((id(module), name), None)
                entry = _WRAPPED[(id(module), name)]
                entry[0] -= 1
                if entry[0] == 0:
                    setattr(module, name, entry[1])
                    del _WRAPPED[(id(module), name)]


def _counted(module, name, real):
    def call(*args, **kwargs):
        count = (getattr(_THIS_RANK, "counting", None) or {}).get((id(module), name))
        if count is not None:
            count(name, args, kwargs)
        return real(*args, **kwargs)
    return call


def _route(message, category, filename, lineno, file=None, line=None) -> None:
    found = getattr(_THIS_RANK, "found", None)
    if found is not None:
        found.append(warnings.WarningMessage(message, category, filename, lineno, file, line))
    else:
        _SHOW(message, category, filename, lineno, file, line)


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

    saved, environ = library_globals(), dict(os.environ)  # what ranks set process-wide ends with the run
    multi_threaded_pg._install_threaded_pg()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    threads = [threading.Thread(target=rank_main, args=(rank,), name=f"rank{rank}", daemon=True)
               for rank in range(world)]
    try:
        with warnings.catch_warnings():  # every warning reaches _route, which gives it to its rank's recorder
            warnings.simplefilter("always")
            warnings.showwarning = _route
            for thread in threads:
                thread.start()
            deadline = time.monotonic() + timeout
            for thread in threads:
                thread.join(max(0.0, deadline - time.monotonic()))
    finally:
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        multi_threaded_pg._uninstall_threaded_pg()
        restore_library_state(saved)
        os.environ.clear()
        os.environ.update(environ)
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
