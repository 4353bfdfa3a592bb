"""Ranks as real processes, and launches as users launch (torchrun, ``python -m lightning_optim.train``).

    results = run_workers(2, my_fn, 3.0, timeout=60)   # my_fn(rank, world_size, 3.0) on each rank, in order

Most multi-rank tests run their ranks as threads (``tests/ranks.py``). These run them as processes: a rank that
dies or hangs on purpose (a thread cannot be killed, and a gloo group torn down under a hung collective takes
its process with it), a rank's own environment variables, bytes read off a process's sockets
(``tests/wire.py``), DDP hooks whose futures complete on gloo's own threads (outside any rank thread's group),
and Lightning's and Accelerate's process-wide rank state.

Each rank is a new process forked by multiprocessing's fork server, which imported torch, lightning-optim and
Lightning once for this pytest process (``spawn`` instead when the call gives ``env=``: an import would have
read the environment before it was set). It joins a gloo process group over TCP on 127.0.0.1 (a free port per
call), sets one intra-op thread and calls ``fn(rank, world_size, *args)``; ``fn`` and its result must pickle.

A rank that raises gives ``WorkerError`` with its traceback; past ``timeout`` every rank is killed
(``TimeoutError``); a rank that exits without reporting gives ``WorkerError``, or ``None`` with ``missing_ok=True``.
A rank that has reported keeps its group until all have (rank 0 hosts the store). ``pg_timeout``: the group's
collective timeout (default ``timeout``).
"""
from __future__ import annotations

import os
import pickle
import queue as queue_mod
import socket
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

__all__ = ["run_workers", "run_torchrun", "run_cli", "run_module", "run_process", "run_script", "torchrun_results",
           "free_port", "error_text", "WorkerError"]

ERROR_GRACE_S = 3.0
PRELOAD = ["lightning_optim", "lightning.pytorch"]  # what nearly every rank imports: once per fork server


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


def run_torchrun(script, *args: str, cwd, nproc: int = 2, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --nproc_per_node N script *args``, as users launch, on a free port;
    returns the finished process after asserting it succeeded (its stderr's tail otherwise). A timeout kills
    torchrun and its ranks (a session of their own)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
               str(free_port()), str(script), *map(str, args)]
    done = run_process(command, cwd=cwd, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def run_cli(args: list[str], *, cwd, env: dict[str, str] | None = None, timeout: float = 240
            ) -> subprocess.CompletedProcess:
    """``python -m lightning_optim.train *args`` in ``cwd``, as a user runs the main job."""
    return run_module("lightning_optim.train", args, cwd=cwd, env=env, timeout=timeout)


def run_module(module: str, args: list[str], *, cwd, env: dict[str, str] | None = None, timeout: float = 240
               ) -> subprocess.CompletedProcess:
    """``python -m <module> *args`` in ``cwd`` (environment: ``env``, default this process's)."""
    return run_process([sys.executable, "-m", module, *map(str, args)], cwd=cwd, env=env, timeout=timeout)


def run_process(command: list[str], *, cwd, timeout: float, env: dict[str, str] | None = None
                ) -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, text=True)`` in a session of its own, whose processes are
    all killed when ``timeout`` passes (``subprocess.TimeoutExpired`` then, as ``subprocess.run`` raises)."""
    with subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          stdin=subprocess.DEVNULL, text=True, start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:
            os.killpg(proc.pid, 9)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def run_script(path, *, cwd, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """``python <path>`` in ``cwd`` with ``env``, as a child of the fork server (torch, lightning-optim and
    Lightning already imported): the script runs as ``__main__`` from its file and costs its own work, not an
    interpreter's start-up. stdout and stderr come back as ``subprocess.run(capture_output=True)`` gives them."""
    out, err = Path(cwd, ".stdout"), Path(cwd, ".stderr")
    proc = _context(None).Process(target=_script_main, args=(str(path), str(cwd), env, str(out), str(err)))
    proc.start()
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join(1.0)
        raise subprocess.TimeoutExpired([sys.executable, str(path)], timeout, out.read_text(), err.read_text())
    return subprocess.CompletedProcess([sys.executable, str(path)], proc.exitcode, out.read_text(), err.read_text())


def _script_main(path: str, cwd: str, env: dict[str, str], out: str, err: str) -> None:
    import runpy

    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, name in ((1, out), (2, err)):
        os.dup2(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    if env.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv, sys.path[0:0] = [path], [os.path.dirname(path)]
    code = 0
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:  # noqa: BLE001 - printed as the interpreter would
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)


def torchrun_results(script, out, *args: str, cwd, nproc: int = 2) -> list:
    """``run_torchrun(script, out, *args)`` for a script that saves ``out/rank<r>.pt`` on each rank; the
    ranks' saved objects, in rank order."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    run_torchrun(script, out, *args, cwd=cwd, nproc=nproc)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(nproc)]


def _worker(rank, world_size, port, fn, args, env, pg_timeout, results, all_reported):
    if env:
        os.environ.update({str(k): str(v) for k, v in env.items()})
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, init_method=f"tcp://127.0.0.1:{port}",
                                timeout=timedelta(seconds=pg_timeout))
        message = ("ok", pickle.dumps(fn(rank, world_size, *args)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        message = ("error", traceback.format_exc())
    results.put((rank, message))
    all_reported.wait(pg_timeout)  # rank 0 hosts the store: nobody leaves while another still uses it
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the result is already reported
        pass


def _context(env: dict | None):
    if env:
        return tmp.get_context("spawn")
    ctx = tmp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _stop(procs, grace: float) -> None:
    """Let released ranks tear their groups down for ``grace`` seconds, then kill what is left."""
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(1.0)


def run_workers(world_size: int, fn, *args, timeout: float = 120.0, env: dict | None = None,
                pg_timeout: float | None = None, missing_ok: bool = False) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks (processes); return results by rank."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    pg_timeout = float(timeout if pg_timeout is None else pg_timeout)
    ctx = _context(env)
    results, all_reported, port = ctx.Queue(), ctx.Event(), free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, env, pg_timeout, results,
                                               all_reported), daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    outputs: dict[int, object] = {}
    errors: dict[int, str] = {}
    start, error_seen_at = time.monotonic(), None
    try:
        while len(outputs) + len(errors) < world_size:
            now = time.monotonic()
            if now - start > timeout:
                pending = sorted(set(range(world_size)) - set(outputs) - set(errors))
                raise TimeoutError(f"run_workers({fn.__name__}) timed out after {timeout:.0f}s; ranks still "
                                   f"running: {pending}" + _details(errors))
            if error_seen_at is not None and now - error_seen_at > ERROR_GRACE_S:
                break
            try:
                rank, (kind, payload) = results.get(timeout=0.05)
            except queue_mod.Empty:
                reported = set(outputs) | set(errors)
                dead = [r for r, p in enumerate(procs) if r not in reported and not p.is_alive()]
                if not dead:
                    continue
                try:  # its message may still be in the pipe
                    rank, (kind, payload) = results.get(timeout=0.5)
                except queue_mod.Empty:
                    for r in dead:
                        if missing_ok:
                            outputs[r] = None
                        else:
                            errors[r] = f"rank {r} exited with code {procs[r].exitcode} without reporting a result\n"
                            error_seen_at = error_seen_at or time.monotonic()
                    continue
            if kind == "ok":
                outputs[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
                error_seen_at = error_seen_at or time.monotonic()
    finally:
        all_reported.set()
        _stop(procs, grace=10.0 if not errors and len(outputs) == world_size else 0.0)  # a rank exits on its own
        results.close()
    if errors:
        raise WorkerError(f"run_workers({fn.__name__}): rank(s) {sorted(errors)} failed:" + _details(errors))
    return [outputs[r] for r in range(world_size)]


def _details(errors: dict[int, str]) -> str:
    return "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
