"""Persistent gloo ranks for ``tests.distributed.run_workers``: started once per pytest process, reused by
every call, so a call pays for a process group instead of for starting Python and importing torch,
Lightning and the tested modules again on every rank.

Worker ``r`` is always rank ``r`` (a world of 2 uses workers 0-1 of the pool, a world of 4 workers 0-3), so
per-rank process state (Lightning's ``rank_zero_only.rank``) is what a fresh rank ``r`` would have. A call:

1. the parent picks a free port and sends every rank ``fn``, its arguments, ``env``, the port, the group
   timeout, and its own current ``os.environ`` and cwd (what a rank spawned now would inherit);
2. each rank snapshots its process state, takes the parent's environment and cwd, applies ``env``, reseeds
   torch/random/numpy from fresh entropy (a fresh process's seeds are random too: no test can rely on
   one), sets one thread, joins a new gloo group over a new TCP store, runs ``fn`` inside
   ``warnings.catch_warnings()`` and reports;
3. once every rank has reported, the parent releases them: each destroys its process groups, restores the
   snapshot (``os.environ``, cwd, ``sys.path``/``argv``, torch's default dtype, grad mode, deterministic
   and anomaly flags, matmul precision, signal handlers; lightning-optim's module globals such as
   ``set_collective_timeout``'s bound; its ``comm_stats()`` counter and caches emptied) and answers
   ``clean`` - or retires (exits) when it cannot vouch for itself (a group still initialised, a non-daemon
   thread still running, ``accel_plugins.hf.register()`` in force: its patches of transformers are
   process-wide). Accelerate's singletons are reset as its own test suite resets them.

What a pool rank cannot give: a module imported by an earlier call is not imported again, so an environment
variable read at import time keeps the value it had then (``run_workers`` therefore goes fresh for ``env=``).

How a rank starts: forked by a *fork server* (multiprocessing's ``forkserver`` start method, one server per
pytest process, started on first use) that imported ``PRELOAD`` - torch, lightning-optim and Lightning,
~7-10 s of CPU per interpreter on the 2-core machine - instead of a ``spawn``ed interpreter importing them
again for every rank. The server itself is forked from ``tests.cli``'s zygote (which imported them, and
Accelerate and transformers, already), so the pytest process pays those imports once for both. The rank is
still a new process (new pid, no state from earlier calls); what it cannot give is what an import decides:
those modules read the environment of the pytest process when the zygote started. ``start_method(env)`` is therefore ``spawn`` for a fresh call with ``env=``.

A call in which any rank fails, dies or times out kills that call's workers (the next call spawns new ones),
so no group a failed collective left behind is ever reused. The parent treats results, tracebacks, deaths
and timeouts exactly as the fresh-process path does (same messages).
"""
from __future__ import annotations

import gc
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait as wait_any

import torch
import torch.multiprocessing as tmp

from tests.library_state import library_globals, reset_accelerate, restore_library_state

LOG_ENV = "LIGHTNING_OPTIM_TEST_POOL_LOG"  # a file: one line per rank started, call run and rank retired
START_TIMEOUT_S = 600.0  # starting a rank (importing torch and lightning_optim) on a loaded machine
RELEASE_TIMEOUT_S = 60.0  # a released rank tearing its groups down; past it the rank is replaced (no error)
ERROR_GRACE_S = 3.0  # after a rank fails: time for the others to report their own errors

# What the fork server imports before it forks a rank: what nearly every call imports (the Lightning tests'
# ranks import Lightning; the rest import lightning-optim, which imports torch).
PRELOAD = ("tests.worker_pool", "lightning_optim", "lightning.pytorch")

_SIGNALS = [getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP")
            if hasattr(signal, name)]


# ---------------------------------------------------------------------------------------- rank side

def _snapshot() -> dict:
    return dict(
        environ=dict(os.environ), cwd=os.getcwd(), path=list(sys.path), argv=list(sys.argv),
        streams=(sys.stdout, sys.stderr), dtype=torch.get_default_dtype(), grad=torch.is_grad_enabled(),
        deterministic=(torch.are_deterministic_algorithms_enabled(),
                       torch.is_deterministic_algorithms_warn_only_enabled()),
        anomaly=(torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
        matmul=torch.get_float32_matmul_precision(),
        signals={s: signal.getsignal(s) for s in _SIGNALS},
    )


def _restore(state: dict, module_globals: dict[str, dict[str, object]]) -> None:
    os.environ.clear()
    os.environ.update(state["environ"])
    os.chdir(state["cwd"])
    sys.path[:] = state["path"]
    sys.argv[:] = state["argv"]
    sys.stdout, sys.stderr = state["streams"]
    torch.set_default_dtype(state["dtype"])
    torch.set_grad_enabled(state["grad"])
    torch.use_deterministic_algorithms(state["deterministic"][0], warn_only=state["deterministic"][1])
    torch.autograd.set_detect_anomaly(*state["anomaly"])
    torch.set_float32_matmul_precision(state["matmul"])
    for sig, handler in state["signals"].items():
        if handler is not None and signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)
    reset_accelerate(keep_process_group=False)
    restore_library_state(module_globals)


def _reseed() -> None:
    import random

    torch.seed()
    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _leftovers() -> str | None:
    """Why this rank cannot serve another call (None: it can)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return "a process group is still initialised"
    alive = [t.name for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive()
             and not t.daemon]
    if alive:
        return f"non-daemon threads still running: {alive}"
    hf_register = sys.modules.get("accel_plugins._hf_register")
    if getattr(hf_register, "_registration", None) is not None:
        return "accel_plugins.hf.register() patched transformers"
    return None


def _serve(rank: int, conn) -> None:
    """A pool rank's main loop (the target of the spawned process)."""
    import warnings

    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        import lightning_optim  # noqa: F401 - what nearly every call imports; its globals are the baseline
    except Exception:  # noqa: BLE001 - a call that needs it reports the import error itself
        pass
    baseline = library_globals()
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message[0] != "call":
            return
        _, call_id, payload = message
        state = _snapshot()
        try:
            call = pickle.loads(payload)
            fn, args, env, world_size = call["fn"], call["args"], call["env"], call["world_size"]
            # what a rank spawned now would inherit: the parent's environment and working directory
            os.environ.clear()
            os.environ.update(call["environ"])
            if env:
                os.environ.update({str(k): str(v) for k, v in env.items()})
            os.chdir(call["cwd"])
            _reseed()
            torch.set_num_threads(1)
            with warnings.catch_warnings():
                dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                        init_method=f"tcp://127.0.0.1:{call['port']}",
                                        timeout=timedelta(seconds=call["pg_timeout"]))
                out = fn(rank, world_size, *args)
            reply = ("ok", call_id, pickle.dumps(out))
        except BaseException:  # noqa: BLE001 - everything goes back to the parent
            reply = ("error", call_id, traceback.format_exc())
        conn.send(reply)
        # Stay in the group until every rank has reported (rank 0 hosts the store a late rank may still use).
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message[:2] != ("release", call_id):
            return
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
            # the call's garbage in reference cycles (DDP reducers, comm-hook states, futures) is freed now, not
            # by a collection during the next call: a gloo object destroyed on one of its own threads aborts
            # the process (std::terminate, "Resource deadlock avoided"), which here retires the rank at worst
            gc.collect()
            _restore(state, baseline)
            problem = _leftovers()
        except BaseException:  # noqa: BLE001
            problem = "teardown failed:\n" + traceback.format_exc()
        conn.send(("clean", call_id, problem))
        if problem is not None:
            return  # retire: the parent spawns a fresh rank for the next call


# -------------------------------------------------------------------------------------- parent side

def start_method(env: dict | None = None):
    """The multiprocessing context ranks start from: the preloaded fork server; ``spawn`` when the call sets
    environment variables (an import in the server read the environment before they were set). The server
    runs from this process's cwd and environment: a preload it cannot import is skipped (the rank then
    imports it itself), so the choice costs time, never a result."""
    if env:
        return tmp.get_context("spawn")
    ctx = tmp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    _fork_server_from_the_zygote()
    return ctx


def _fork_server_from_the_zygote() -> None:
    """Start multiprocessing's fork server, if it is not running, through ``tests/forked_python.py``: the server
    is then forked from ``tests.cli``'s zygote, which imported ``PRELOAD`` (and more) already, instead of being a
    new interpreter importing them again. multiprocessing still starts it (its own command line, descriptors
    and bookkeeping; the stand-in is its child) and, should the server die, starts the next one itself."""
    from multiprocessing import forkserver, resource_tracker, spawn

    from tests.cli import forked_python, forked_python_environment

    try:
        executable, environment = forked_python(), forked_python_environment()
    except RuntimeError:  # no zygote: multiprocessing starts a new interpreter, as it would anyway
        return
    resource_tracker.ensure_running()  # with the real interpreter (the stand-in forks only the fork server)
    real, saved = spawn.get_executable(), {k: os.environ.get(k) for k in environment}
    spawn.set_executable(executable)
    os.environ.update(environment)
    try:
        forkserver.ensure_running()
    finally:
        spawn.set_executable(real)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _rss_mib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration, ValueError):
        return None


def log(line: str) -> None:
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a") as f:
            f.write(f"{time.strftime('%H:%M:%S')} {line}\n")


def record(outputs: dict, errors: dict, rank: int, kind: str, payload) -> bool:
    """Put rank ``rank``'s report (``"ok"`` with its pickled result, else its traceback text) where it belongs;
    True for an error. Both ways of running ranks report alike."""
    if kind == "ok":
        outputs[rank] = pickle.loads(payload)
        return False
    errors[rank] = payload
    return True


class _Rank:
    def __init__(self, rank: int) -> None:
        ctx = start_method()
        self.conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=_serve, args=(rank, child), daemon=True, name=f"pool-rank-{rank}")
        self.process.start()
        child.close()
        self.ready = False

    def alive(self) -> bool:
        return self.process.is_alive()

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(2.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(2.0)
        self.conn.close()


class PoolUnavailable(RuntimeError):
    """The pool could not start its ranks (the caller falls back to fresh processes)."""


class Pool:
    """Ranks ``0..n-1``, started on demand and replaced when they die or misbehave."""

    def __init__(self) -> None:
        self.ranks: list[_Rank | None] = []
        self.owner = os.getpid()
        self._calls = 0

    # ---------------------------------------------------------------- lifecycle
    def _ensure(self, world_size: int) -> list[_Rank]:
        while len(self.ranks) < world_size:
            self.ranks.append(None)
        for r in range(world_size):
            rank = self.ranks[r]
            if rank is not None and not rank.alive():
                rank.kill()
                self.ranks[r] = rank = None
            if rank is None:
                self.ranks[r] = _Rank(r)
                log(f"start rank {r}")
        deadline = time.monotonic() + START_TIMEOUT_S
        for r in range(world_size):
            rank = self.ranks[r]
            while not rank.ready:
                left = deadline - time.monotonic()
                if left <= 0 or not wait_any([rank.conn, rank.process.sentinel], left):
                    self.discard(range(world_size))
                    raise PoolUnavailable(f"pool rank {r} did not start within {START_TIMEOUT_S:.0f}s")
                try:
                    kind = rank.conn.recv()[0]
                except (EOFError, OSError):
                    kind = "died"
                if kind != "ready":
                    self.discard(range(world_size))
                    raise PoolUnavailable(f"pool rank {r} exited while starting")
                rank.ready = True
        return self.ranks[:world_size]

    def discard(self, ranks) -> None:
        for r in ranks:
            if r < len(self.ranks) and self.ranks[r] is not None:
                self.ranks[r].kill()
                self.ranks[r] = None

    def close(self) -> None:
        for rank in self.ranks:
            if rank is not None:
                try:
                    rank.conn.send(("stop",))
                except (OSError, ValueError):
                    pass
        for rank in self.ranks:
            if rank is not None:
                rank.process.join(2.0)
        self.discard(range(len(self.ranks)))

    # ---------------------------------------------------------------- one call
    def run(self, world_size: int, name: str, payload: bytes, *, timeout: float):
        """Run ``payload`` (a pickled dict: fn, args, env, world_size, port, pg_timeout, and the parent's
        environ and cwd) on ranks ``0..world_size-1``: ``(outputs, errors)`` by rank, as the fresh path collects them; raises
        TimeoutError itself, PoolUnavailable when the ranks cannot start."""
        ranks = self._ensure(world_size)
        self._calls += 1
        call_id = self._calls
        outputs: dict[int, object] = {}
        errors: dict[int, str] = {}
        healthy = False
        try:
            for rank in ranks:
                rank.conn.send(("call", call_id, payload))
            start = time.monotonic()
            error_seen_at = None
            while len(outputs) + len(errors) < world_size:
                now = time.monotonic()
                if now - start > timeout:
                    pending = sorted(set(range(world_size)) - set(outputs) - set(errors))
                    detail = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
                    raise TimeoutError(f"run_workers({name}) timed out after {timeout:.0f}s; ranks still "
                                       f"running: {pending}" + detail)
                if error_seen_at is not None and now - error_seen_at > ERROR_GRACE_S:
                    break
                waiting = {r: ranks[r] for r in range(world_size) if r not in outputs and r not in errors}
                ready = wait_any([x for rank in waiting.values() for x in (rank.conn, rank.process.sentinel)], 0.5)
                for r, rank in waiting.items():
                    if rank.conn not in ready and rank.process.sentinel not in ready:
                        continue
                    got = None
                    if rank.conn.poll():  # a rank that died right after reporting: its message still counts
                        try:
                            got = rank.conn.recv()
                        except (EOFError, OSError):
                            got = None
                    if got is not None:
                        kind, got_id, body = got
                        if got_id != call_id:
                            continue
                        if record(outputs, errors, r, kind, body):
                            error_seen_at = error_seen_at or time.monotonic()
                    elif not rank.alive() or rank.process.sentinel in ready:
                        rank.process.join(1.0)
                        errors[r] = f"rank {r} exited with code {rank.process.exitcode} without reporting a result\n"
                        error_seen_at = error_seen_at or time.monotonic()
            healthy = not errors
            if os.environ.get(LOG_ENV):
                log(f"call {name} on {world_size} ranks: {'ok' if healthy else 'failed'} in "
                    f"{time.monotonic() - start:.1f}s, rss MiB {[_rss_mib(rank.process.pid) for rank in ranks]}")
        finally:
            if healthy:
                self._release(ranks, call_id)
            else:  # a failed, dead, timed-out or interrupted call: none of its ranks is reused
                log(f"discard ranks 0-{world_size - 1} after {name}: failed, died, timed out or interrupted")
                self.discard(range(world_size))
        return outputs, errors

    def _release(self, ranks: list[_Rank], call_id: int) -> None:
        for rank in ranks:
            try:
                rank.conn.send(("release", call_id))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + RELEASE_TIMEOUT_S
        for r, rank in enumerate(ranks):
            problem = f"no answer within {RELEASE_TIMEOUT_S:.0f}s of its release"
            while time.monotonic() < deadline:
                if not wait_any([rank.conn, rank.process.sentinel], max(0.0, deadline - time.monotonic())):
                    break
                try:
                    kind, got_id, answer = rank.conn.recv()
                except (EOFError, OSError, ValueError):
                    problem = f"exited after its release (code {rank.process.exitcode})"
                    break
                if kind == "clean" and got_id == call_id:
                    problem = answer
                    break
            if problem is not None:  # it retired or hung in teardown: the result stands, the rank is replaced
                log(f"retire rank {r}: {problem}")
                self.discard([r])


_POOL: Pool | None = None


def pool() -> Pool:
    """This process's pool (a forked child gets its own: the parent's pipes are not its to use)."""
    global _POOL
    if _POOL is None or _POOL.owner != os.getpid():
        _POOL = Pool()
    return _POOL


def shutdown() -> None:
    """Stop the pool's ranks (the session's end; they are daemons, so an abrupt exit ends them too)."""
    global _POOL
    if _POOL is not None and _POOL.owner == os.getpid():
        _POOL.close()
    _POOL = None
