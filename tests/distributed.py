"""Multi-process test harness: run a function on ``world_size`` real gloo ranks.

    results = run_workers(2, my_fn, 3.0, timeout=60)   # my_fn(rank, world_size, 3.0) on each rank

Each rank joins a gloo process group over TCP on 127.0.0.1 (a free port picked by the parent, a new one
per call), sets ``torch.set_num_threads(1)`` and calls ``fn(rank, world_size, *args)``. ``fn`` must be a
module-level (picklable) function; its return value must be picklable (tensors are fine: they travel as
pickled bytes, not shared memory).

Where the ranks run:
* by default on persistent ranks (``tests/worker_pool.py``), started once per pytest process and reused:
  rank ``r`` is always the same process; each call gets a new process group over a new TCP store, the
  parent's current environment and cwd, fresh random seeds, and leaves the rank's process state as it
  found it (environment, cwd, torch's global flags, lightning-optim's module globals and counters); a
  call that fails, dies or times out replaces its ranks. ``timeout`` counts from the moment the ranks
  are running (their start-up has its own bound);
* ``fresh=True``: new processes for this call alone (forked by the pool's preloaded fork server; ``spawn``ed
  interpreters when the call gives ``env=``). The default where a rank
  is meant to die (``missing_ok=True``) or the call sets environment variables (``env=``: a module an
  earlier call imported would not read them again). Give it where a call's collectives are meant to time
  out. ``LIGHTNING_OPTIM_TEST_POOL=0`` makes every
  call fresh (and ``LIGHTNING_OPTIM_TEST_POOL_LOG=<file>`` logs the pool's starts, calls and retirements).

Failure handling (both ways):
* a rank that raises -> ``WorkerError`` carrying that rank's traceback text (the other ranks are
  given a short grace period to report their own errors, then killed);
* ``timeout`` seconds pass (whole run) -> every process is killed and ``TimeoutError`` is raised;
* a rank that has reported stays (its process group alive) until every rank has reported or the run
  ends, so a rank done early never takes rank 0's rendezvous store away from the others;
* a rank that exits without reporting -> ``WorkerError`` unless ``missing_ok=True``, in which case
  its entry in the returned list is ``None`` (for tests that make a rank die on purpose).

``pg_timeout`` is the process group's collective timeout (default: ``timeout``); ``env`` is applied
to ``os.environ`` in each rank before the process group is created.
"""
from __future__ import annotations

import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from tests import worker_pool

__all__ = ["run_workers", "run_torchrun", "torchrun_results", "free_port", "error_text", "WorkerError"]

_ERROR_GRACE_S = 3.0
POOL_ENV = "LIGHTNING_OPTIM_TEST_POOL"  # "0": every call in fresh processes


class WorkerError(RuntimeError):
    """A worker rank raised (or died); the message holds the child's traceback."""


def error_text(fn) -> str:
    """``"TypeName: message"`` of the ValueError/TypeError ``fn()`` raises, or ``"no error"`` (for worker
    functions that report refusals back to the test instead of failing the rank)."""
    try:
        fn()
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(script, *args: str, cwd, nproc: int = 2, timeout: float = 300, fresh: bool = False):
    """``python -m torch.distributed.run --nproc_per_node N script *args`` (the way users launch), on a
    free port; returns the finished process after asserting it succeeded (stderr's tail otherwise).

    torchrun and its ranks are forked from ``tests.cli``'s zygote (the ranks through torchrun's own
    ``PYTHON_EXEC``: ``tests/forked_python.py``), which imported torch, Lightning, transformers, Accelerate and
    lightning-optim once. ``fresh=True`` (the examples' tests): rank 0 is a new interpreter, as a user's shell
    starts it - the script's imports and start-up from nothing - the other ranks forked as usual."""
    from tests.cli import forked_python, run_module
    from tests.forked_python import FRESH_RANK_ENV

    torchrun_args = ["--nproc_per_node", str(nproc), "--master_port", str(free_port()), str(script), *map(str, args)]
    env = {**os.environ, "PYTHON_EXEC": forked_python()}
    if fresh:
        env[FRESH_RANK_ENV] = "0"
    done = run_module("torch.distributed.run", torchrun_args, cwd=cwd, timeout=timeout, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def torchrun_results(script, out, *args: str, cwd, nproc: int = 2) -> list:
    """``run_torchrun(script, out, *args)`` for a script that saves ``out/rank<r>.pt`` on each rank; the
    ranks' saved objects, in rank order."""
    import torch
    from pathlib import Path

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    run_torchrun(script, out, *args, cwd=cwd, nproc=nproc)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(nproc)]


def _worker(rank, world_size, port, fn, args, env, pg_timeout, results, all_reported):
    if env:
        os.environ.update({str(k): str(v) for k, v in env.items()})
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            rank=rank,
            world_size=world_size,
            init_method=f"tcp://127.0.0.1:{port}",
            timeout=timedelta(seconds=pg_timeout),
        )
        out = fn(rank, world_size, *args)
        message = ("ok", pickle.dumps(out))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        message = ("error", traceback.format_exc())
    results.put((rank, message))
    # Stay until every rank has reported: rank 0 hosts the rendezvous store, and a rank done early
    # (outside a subgroup, say) that left would take the store with it while the others still use it.
    all_reported.wait(pg_timeout)
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the result is already reported
        pass


def _let_exit(procs, grace: float = 2.0) -> None:
    """Give ranks released by ``all_reported`` a moment to tear their process group down themselves."""
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))


def _kill(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 2.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(1.0)


def run_workers(
    world_size: int,
    fn,
    *args,
    timeout: float = 120.0,
    env: dict | None = None,
    pg_timeout: float | None = None,
    missing_ok: bool = False,
    fresh: bool | None = None,
) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    pg_timeout = float(timeout if pg_timeout is None else pg_timeout)
    if fresh is None:
        fresh = missing_ok or env is not None or os.environ.get(POOL_ENV, "1").strip() == "0"
    outcome = None
    if not fresh:
        try:
            payload = pickle.dumps(dict(fn=fn, args=args, env=env, world_size=world_size, port=free_port(),
                                        pg_timeout=pg_timeout, environ=dict(os.environ), cwd=os.getcwd()))
        except (pickle.PicklingError, AttributeError, TypeError):
            payload = None  # arguments only multiprocessing's pickler takes (shared-memory handles): fresh processes
        if payload is not None:
            try:
                outcome = worker_pool.pool().run(world_size, fn.__name__, payload, timeout=timeout)
            except worker_pool.PoolUnavailable:
                outcome = None  # the ranks could not start: fresh processes
    if outcome is None:
        worker_pool.log(f"fresh {fn.__name__} on {world_size} ranks")
        outcome = _run_fresh(world_size, fn, args, timeout=timeout, env=env, pg_timeout=pg_timeout,
                             missing_ok=missing_ok)
    outputs, errors = outcome
    if errors:
        detail = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        raise WorkerError(
            f"run_workers({fn.__name__}): rank(s) {sorted(errors)} failed:" + detail
        )
    return [outputs[r] for r in range(world_size)]


def _run_fresh(world_size: int, fn, args: tuple, *, timeout: float, env, pg_timeout: float,
               missing_ok: bool) -> tuple[dict, dict]:
    """One new process per rank (``worker_pool.start_method``); ``(outputs, errors)`` by rank."""
    ctx = worker_pool.start_method(env)
    results = ctx.Queue()
    all_reported = ctx.Event()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, fn, args, env, pg_timeout, results, all_reported),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()

    outputs: dict[int, object] = {}
    errors: dict[int, str] = {}
    start = time.monotonic()
    error_seen_at = None
    try:
        while len(outputs) + len(errors) < world_size:
            now = time.monotonic()
            if now - start > timeout:
                pending = sorted(set(range(world_size)) - set(outputs) - set(errors))
                _kill(procs)
                detail = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
                raise TimeoutError(
                    f"run_workers({fn.__name__}) timed out after {timeout:.0f}s; ranks still "
                    f"running: {pending}" + detail
                )
            if error_seen_at is not None and now - error_seen_at > _ERROR_GRACE_S:
                break
            try:
                rank, (kind, payload) = results.get(timeout=0.05)
            except queue_mod.Empty:
                # a process that is dead and has reported nothing will never report
                reported = set(outputs) | set(errors)
                dead = [r for r, p in enumerate(procs) if r not in reported and not p.is_alive()]
                if dead:
                    # its message may still be in the pipe: drain once more before judging
                    try:
                        rank, (kind, payload) = results.get(timeout=0.5)
                    except queue_mod.Empty:
                        for r in dead:
                            if missing_ok:
                                outputs[r] = None
                            else:
                                errors[r] = (
                                    f"rank {r} exited with code {procs[r].exitcode} "
                                    "without reporting a result\n"
                                )
                                error_seen_at = error_seen_at or time.monotonic()
                        continue
                else:
                    continue
            if worker_pool.record(outputs, errors, rank, kind, payload):
                error_seen_at = error_seen_at or time.monotonic()
    finally:
        all_reported.set()
        if not errors and len(outputs) == world_size:
            _let_exit(procs)
        _kill(procs)
        results.close()

    return outputs, errors
