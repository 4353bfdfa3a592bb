"""Run ``python -m lightning_optim.train ...`` for a test without paying the interpreter start-up each time.

Importing the job (torch, Lightning, Hydra, matplotlib) costs ~7 s of CPU per fresh interpreter. ``run_cli``
instead forks the run from a *zygote*: one helper interpreter per pytest process (per xdist worker), started
on first use, that imported the job's modules once and then forks a child per call. The child becomes what
``python -m lightning_optim.train <args>`` would be, and ``run_cli`` returns what
``subprocess.run(command, cwd=..., env=..., capture_output=True, text=True, timeout=...)`` returns.

What the forked child gives, as a fresh interpreter would:
  * ``runpy._run_module_as_main`` (what ``python -m`` itself calls) runs the module in ``__main__``:
    ``__main__.__spec__.name``, ``sys.argv`` (``argv[0]`` = the module's file), ``sys.orig_argv``, ``sys.executable``;
    Lightning's launcher therefore starts the other ranks as ``[sys.executable, "-m", "lightning_optim.train",
    *sys.argv[1:]]`` (``_hydra_subprocess_cmd`` adds hydra.run.dir etc.): those ranks are fresh interpreters.
  * ``os.environ`` = ``env`` (default: this process's environment now), cwd, ``sys.path`` as ``python -m``
    computes it (cwd, then ``PYTHONPATH``, then the standard entries), ``PYTHONWARNINGS`` and
    ``PYTHONUNBUFFERED`` applied as start-up applies them.
  * stdout and stderr are pipes (fds 1 and 2) that every process the run starts inherits; they are read until
    every writer has closed them, as ``communicate`` does. stdin is /dev/null.
  * the exit status: ``SystemExit`` mapped as the interpreter maps it (None -> 0, an int, anything else
    printed on stderr -> 1), an uncaught exception printed by ``sys.excepthook`` from the same frames
    (``<frozen runpy>`` down) -> 1, ``KeyboardInterrupt`` -> killed by SIGINT; non-daemon threads are joined,
    then the ``atexit`` handlers run and the streams are flushed (done here: the child ends in ``os._exit``).
  * a process group of its own: a timeout (or an interrupted test: ^C, pytest-timeout) kills the run and
    everything it started, then raises ``subprocess.TimeoutExpired`` as ``subprocess.run`` does. (The zygote
    ignores SIGINT; a run gets Python's usual handler back.)

Only the process ``run_cli`` starts is forked: the other ranks of a multi-process run are fresh interpreters
and rank 0 waits for them at the rendezvous, so there the saving is CPU (one import less), not wall time.

What it does not give - keep ``subprocess.run`` where a test is about these:
  * anything decided while modules are imported: the modules the zygote imported keep the zygote's state. An
    environment variable read at import (Lightning's rank from RANK/LOCAL_RANK, OpenMP's OMP_NUM_THREADS,
    ``PYTHONHASHSEED``, ``PYTHONIOENCODING``, ``PYTHONPATH`` for those modules' location) has the zygote's
    value - the environment of this process when the zygote started, less PYTHONPATH/PYTHONWARNINGS; a
    warning an import would issue is issued in the zygote, not shown by the run; ``warnings`` filters that
    imports install are the zygote's.
  * import-time behaviour itself, packaging (which copy of a module gets imported), interpreter options.
  * interpreter teardown: objects still alive at exit are not finalized (no ``__del__`` of module globals,
    no C++ destructors); ``atexit`` handlers and ``logging.shutdown`` do run.
  * the zygote's random state is shared: the hash seed, and numpy's global generator until the job seeds it.
  * extra modules: ``tests.cli`` and the ones the zygote imported are in ``sys.modules`` before the run starts.

Fork safety: the zygote only imports, never computes (no torch thread pool, no ``torch.distributed``, no
CUDA); the two OpenBLAS pools numpy and scipy start at import stop themselves before every fork (their
``pthread_atfork`` handlers), so the zygote is single-threaded when it forks.

Why not multiprocessing's "forkserver" with ``set_forkserver_preload``: its child is a multiprocessing child
(``current_process()`` is "Process-N", ``parent_process()`` is set, the default start method is forced to
forkserver, so DataLoader workers would go through it too), ``spawn.prepare`` replaces sys.path/argv/cwd and
may re-run the pytest script as ``__mp_main__``, Python 3.11's forkserver ignores the sys.path it is given for
the preload (an ImportError there is silently skipped), and there is one forkserver per process for everyone.
The zygote here is a plain interpreter with a small request loop over a Unix socket (``socket.send_fds``
passes the run's stdout/stderr pipes).
"""

from __future__ import annotations

import atexit
import errno
import json
import locale
import os
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import IO, Any, NoReturn

JOB = "lightning_optim.train"
# What the zygote imports before it forks: the job imports everything it needs at import time.
PRELOAD = (JOB,)
REPO_ROOT = Path(__file__).resolve().parents[1]
# Start-up of the zygote itself (its imports) may take long on a busy machine; not counted in a run's timeout.
ZYGOTE_START_TIMEOUT_S = 600
_MESSAGE_BYTES = 1 << 20  # one request: the command line and the environment


def run_cli(args: list[str], *, cwd: str | os.PathLike, env: dict[str, str] | None = None,
            timeout: float = 240) -> subprocess.CompletedProcess:
    """``python -m lightning_optim.train *args`` forked from the zygote; as ``subprocess.run(...,
    capture_output=True, text=True)`` of that command would return (``args`` is that command)."""
    return run_module(JOB, args, cwd=cwd, env=env, timeout=timeout)


def run_module(module: str, args: list[str], *, cwd: str | os.PathLike, env: dict[str, str] | None = None,
               timeout: float = 240) -> subprocess.CompletedProcess:
    """``python -m <module> *args`` forked from the zygote (any module: the harness tests run probes)."""
    command = [sys.executable, "-m", module, *args]
    if not os.path.isdir(cwd):  # as subprocess.run fails, before anything starts
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(cwd))
    request = {"module": module, "args": list(args), "cwd": os.path.abspath(cwd),
               "env": dict(os.environ if env is None else env)}
    return _zygote().run(request, command, timeout)


def zygote_pid() -> int:
    """The process id of this process's zygote (started if need be)."""
    return _zygote().pid


# ------------------------------------------------------------------------------------------- this process
class _Zygote:
    """The client's end: starts the zygote and asks it for one forked run at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests = 0  # each request's id, echoed by the zygote's replies
        self._log: IO[bytes] = tempfile.TemporaryFile()
        self._socket, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sys_path = json.dumps([os.path.abspath(entry) for entry in sys.path])  # "" is this process's cwd
        serve = f"__import__('tests.cli', fromlist=['serve']).serve({theirs.fileno()}, {sys_path!r})"
        self._process = subprocess.Popen(
            [sys.executable, "-c", serve], cwd=REPO_ROOT, env=_zygote_environment(),
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log, pass_fds=[theirs.fileno()])
        theirs.close()
        self.pid = self._process.pid
        if self._receive(time.monotonic() + ZYGOTE_START_TIMEOUT_S) != {"ready": True}:
            self._process.kill()
            raise self._failure(f"did not start within {ZYGOTE_START_TIMEOUT_S} s")

    def alive(self) -> bool:
        return self._process.poll() is None

    def close(self) -> None:
        self._socket.close()  # the zygote stops at end of file
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._log.close()

    def run(self, request: dict[str, Any], command: list[str], timeout: float) -> subprocess.CompletedProcess:
        with self._lock:
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            self._requests += 1
            request = {**request, "id": self._requests}
            try:
                try:
                    pid = self._fork(request, [out_w, err_w])
                finally:  # only the child (and what it starts) may hold the write ends: EOF means all are done
                    os.close(out_w)
                    os.close(err_w)
                return self._collect(request["id"], pid, command, [out_r, err_r], timeout)
            finally:
                os.close(out_r)
                os.close(err_r)

    def _fork(self, request: dict[str, Any], fds: list[int]) -> int:
        message = json.dumps(request).encode()
        if len(message) > _MESSAGE_BYTES:
            raise ValueError(f"the command line and environment take {len(message)} bytes, more than {_MESSAGE_BYTES}")
        socket.send_fds(self._socket, [message], fds)
        return self._reply(request["id"], "pid", None)

    def _collect(self, request_id: int, pid: int, command: list[str], fds: list[int],
                 timeout: float) -> subprocess.CompletedProcess:
        """Read both pipes to their end, then the exit status; past the deadline (or on any interruption,
        e.g. pytest-timeout) kill the run's process group."""
        deadline = time.monotonic() + timeout
        output: dict[int, bytearray] = {fd: bytearray() for fd in fds}
        returncode = None
        try:
            if _read_to_end(output, deadline):
                returncode = self._reply(request_id, "returncode", deadline)
        finally:
            if returncode is None:
                _kill_group(pid)
                self._reply(request_id, "returncode", None)
        stdout, stderr = (bytes(output[fd]) for fd in fds)
        if returncode is None:
            raise subprocess.TimeoutExpired(command, timeout, output=stdout, stderr=stderr)
        return subprocess.CompletedProcess(command, returncode, _text(stdout), _text(stderr))

    def _reply(self, request_id: int, key: str, deadline: float | None) -> Any:
        """The value of ``key`` in the zygote's reply to this request (skipping what an interrupted call left
        unread); None past the deadline."""
        while True:
            reply = self._receive(deadline)
            if reply is None:
                return None
            if reply.get("id") == request_id and key in reply:
                return reply[key]

    def _receive(self, deadline: float | None) -> dict[str, Any] | None:
        """The zygote's next message; None past the deadline."""
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        with selectors.DefaultSelector() as selector:
            selector.register(self._socket, selectors.EVENT_READ)
            if not selector.select(remaining):
                return None
        message = self._socket.recv(_MESSAGE_BYTES)
        if not message:
            raise self._failure("exited")
        return json.loads(message)

    def _failure(self, what: str) -> RuntimeError:
        self._log.seek(0)
        return RuntimeError(f"the tests.cli zygote {what}: {self._log.read().decode(errors='replace')[-5000:]}")


_ZYGOTE: _Zygote | None = None


def _zygote() -> _Zygote:
    global _ZYGOTE
    if _ZYGOTE is None or not _ZYGOTE.alive():
        _ZYGOTE = _Zygote()
        atexit.register(_ZYGOTE.close)
    return _ZYGOTE


def _zygote_environment() -> dict[str, str]:
    """This process's environment, less what a run sets for itself at start-up (its own sys.path and warning
    options): the zygote's start-up state is then the plain interpreter's, for the child to build on."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONWARNINGS")}


def _read_to_end(output: dict[int, bytearray], deadline: float) -> bool:
    """Append what each fd yields until every fd is at end of file (True) or the deadline passes (False)."""
    with selectors.DefaultSelector() as selector:
        for fd in output:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            for key, _ in selector.select(remaining):
                chunk = os.read(key.fd, 1 << 16)
                if chunk:
                    output[key.fd] += chunk
                else:
                    selector.unregister(key.fd)
    return True


def _kill_group(pid: int) -> None:
    """SIGKILL the run's process group: the job and every process it started (Lightning's other ranks)."""
    for kill in (os.killpg, os.kill):  # os.kill: the group may not exist yet (a run interrupted at once)
        try:
            kill(pid, signal.SIGKILL)
            return
        except ProcessLookupError:
            continue


def _text(data: bytes) -> str:
    """As ``subprocess.run(..., text=True)`` decodes: the locale's encoding, universal newlines."""
    return data.decode(locale.getpreferredencoding(False)).replace("\r\n", "\n").replace("\r", "\n")


# ------------------------------------------------------------------------------------------------ the zygote
def serve(sock_fd: int, parent_sys_path: str) -> None:
    """The zygote's main loop: import ``PRELOAD``, then fork one child per request until the client leaves."""
    startup_path = sys.path[1:]  # what any interpreter starts with, less -c's "" (PYTHONPATH is unset here)
    startup_filters = list(warnings.filters)  # the interpreter's defaults: no PYTHONWARNINGS here either
    sys.path[:] = json.loads(parent_sys_path)  # import what the tests import
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C is for pytest; it closes the socket and we stop
    for module in PRELOAD:
        __import__(module)
    sock = socket.socket(fileno=sock_fd)
    sock.send(json.dumps({"ready": True}).encode())
    while True:
        message, fds, _, _ = socket.recv_fds(sock, _MESSAGE_BYTES, 2)
        if not message:
            return
        request = json.loads(message)
        pid = os.fork()
        if pid == 0:
            sock.close()
            _child(request, fds, startup_path, startup_filters)
        _own_group(pid)
        for fd in fds:
            os.close(fd)
        sock.send(json.dumps({"id": request["id"], "pid": pid}).encode())
        _, status = os.waitpid(pid, 0)
        sock.send(json.dumps({"id": request["id"], "returncode": os.waitstatus_to_exitcode(status)}).encode())


def _own_group(pid: int) -> None:
    """The child's own process group, set from both sides so it exists before the client learns the pid."""
    try:
        os.setpgid(pid, pid)
    except OSError:  # the child already did it (and may have started something), or it is gone
        pass


# ------------------------------------------------------------------------------------------------- the child
def _child(request: dict[str, Any], fds: list[int], startup_path: list[str],
           startup_filters: list[Any]) -> NoReturn:
    """Become ``python -m <module> <args>``, run it and exit; never returns into the zygote's loop."""
    code, interrupted = 1, False
    try:
        os.setpgid(0, 0)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _redirect_stdio(*fds)
        env = request["env"]
        os.environ.clear()
        os.environ.update(env)
        os.chdir(request["cwd"])
        sys.path[:] = _fresh_sys_path(env, startup_path)
        _apply_warning_options(env.get("PYTHONWARNINGS", ""), startup_filters)
        _set_buffering(unbuffered=bool(env.get("PYTHONUNBUFFERED")))
        code, interrupted = _run_as_main(request["module"], request["args"])
        _finalize()
    except BaseException:  # a failure of this harness: say so, never fall back into the zygote
        traceback.print_exc()
        code = 1
    finally:
        _flush_stdio()
        if interrupted:  # as the interpreter ends after an uncaught ^C: killed by SIGINT
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code)


def _redirect_stdio(stdout_fd: int, stderr_fd: int) -> None:
    """fds 0-2 as ``capture_output`` sets them (stdin: /dev/null), inherited by whatever the run starts."""
    _flush_stdio()  # nothing of the zygote's may reach the run's output
    devnull = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((devnull, 0), (stdout_fd, 1), (stderr_fd, 2)):
        os.dup2(fd, target)
        os.close(fd)


def _fresh_sys_path(env: dict[str, str], startup_path: list[str]) -> list[str]:
    """``python -m``'s sys.path: the cwd, then PYTHONPATH's entries (absolute), then the standard ones."""
    pythonpath = env.get("PYTHONPATH", "")
    extra = [os.path.abspath(entry) for entry in pythonpath.split(os.pathsep)] if pythonpath else []
    return [os.getcwd(), *extra, *startup_path]


def _apply_warning_options(pythonwarnings: str, startup_filters: list[Any]) -> None:
    """PYTHONWARNINGS's filters where start-up puts them: above the defaults, below any filter an import added."""
    options = [option for option in pythonwarnings.split(",") if option]
    sys.warnoptions[:] = options
    if not options:
        return
    filters = warnings.filters
    boundary = len(filters) - len(startup_filters)
    if boundary < 0 or filters[boundary:] != startup_filters:
        boundary = 0  # an import rearranged the defaults: the options go on top
    above = filters[:boundary]
    del filters[:boundary]
    warnings._processoptions(options)  # parses, reports a bad option and drops a duplicate as start-up does
    filters[:] = above + [f for f in filters if f not in above]  # as the imports' filterwarnings calls would
    warnings._filters_mutated()


def _set_buffering(unbuffered: bool) -> None:
    """As the interpreter opens stdout and stderr on pipes: stdout block-, stderr line-buffered; with
    PYTHONUNBUFFERED both write through."""
    sys.stdout.reconfigure(line_buffering=False, write_through=unbuffered)
    sys.stderr.reconfigure(line_buffering=not unbuffered, write_through=unbuffered)


def _run_as_main(module: str, args: list[str]) -> tuple[int, bool]:
    """Run the module as ``python -m`` does; (exit status, whether an uncaught KeyboardInterrupt ended it)."""
    _forget_preloaded(module)
    sys.argv = ["-m", *args]  # as during -m's search; runpy sets argv[0] to the module's file
    sys.orig_argv = [sys.executable, "-m", module, *args]
    try:
        runpy._run_module_as_main(module, alter_argv=True)
    except SystemExit as exit:
        return _exit_status(exit.code), False
    except BaseException as error:
        _print_uncaught(error)
        return 1, isinstance(error, KeyboardInterrupt)
    return 0, False


def _forget_preloaded(module: str) -> None:
    """The zygote imported the module under its own name; ``python -m`` runs it as ``__main__`` only (and
    runpy warns when it finds the module imported already)."""
    sys.modules.pop(module, None)
    package, _, name = module.rpartition(".")
    if package in sys.modules:
        vars(sys.modules[package]).pop(name, None)


def _exit_status(code: object) -> int:
    """As the interpreter turns ``SystemExit.code`` into an exit status."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _print_uncaught(error: BaseException) -> None:
    """``sys.excepthook`` from ``python -m``'s own first frame (runpy's), not from this harness's frames."""
    tb = error.__traceback__
    main_code = runpy._run_module_as_main.__code__
    while tb is not None and tb.tb_frame.f_code is not main_code:
        tb = tb.tb_next
    error.__traceback__ = tb or error.__traceback__
    sys.excepthook(type(error), error, error.__traceback__)


def _finalize() -> None:
    """What the interpreter does at exit before the process ends: join non-daemon threads, run ``atexit``."""
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()


def _flush_stdio() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed by the run, or its reader went away
            pass
