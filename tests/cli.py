"""Run ``python -m lightning_optim.train ...`` (and torchrun, and the ranks launchers start) for a test without
paying the interpreter start-up each time.

Importing the job (torch, Lightning, Hydra, matplotlib) costs ~7 s of CPU per fresh interpreter, a rank of the
HF scripts ~10 s. ``run_cli`` instead forks the run from a *zygote*: one helper interpreter per pytest process
(per xdist worker), started on first use, that imported ``tests.zygote.PRELOAD`` once and then forks a child per call. The
child becomes what ``python -m lightning_optim.train <args>`` would be, and ``run_cli`` returns what
``subprocess.run(command, cwd=..., env=..., capture_output=True, text=True, timeout=...)`` returns.

What the forked child gives, as a fresh interpreter would:
  * ``runpy._run_module_as_main`` (what ``python -m`` itself calls) runs the module in ``__main__``:
    ``__main__.__spec__.name``, ``sys.argv`` (``argv[0]`` = the module's file), ``sys.orig_argv``.
  * ``os.environ`` = ``env`` (default: this process's ``os.environ`` now) plus the variables the zygote's
    imports set where ``env`` does not (Lightning's: as the same imports in a fresh interpreter would), cwd,
    ``sys.path`` as ``python -m`` computes it (cwd, then ``PYTHONPATH``, then the standard entries),
    ``PYTHONWARNINGS`` and ``PYTHONUNBUFFERED`` applied as start-up applies them.
  * stdout and stderr are pipes (fds 1 and 2) that every process the run starts inherits; they are read until
    every writer has closed them, as ``communicate`` does. stdin is /dev/null.
  * the exit status: ``SystemExit`` mapped as the interpreter maps it (None -> 0, an int, anything else
    printed on stderr -> 1), an uncaught exception printed by ``sys.excepthook`` from the same frames
    (``<frozen runpy>`` down) -> 1, ``KeyboardInterrupt`` -> killed by SIGINT; non-daemon threads are joined,
    then the ``atexit`` handlers run and the streams are flushed (done here: the child ends in ``os._exit``).
  * a process group of its own: a timeout (or an interrupted test: ^C, pytest-timeout) kills the run and
    everything it started, launched ranks included, then raises ``subprocess.TimeoutExpired`` as
    ``subprocess.run`` does. (The zygote ignores SIGINT; a run gets Python's usual handler back.)

Launched ranks (``fork_launched``, the default): the run's ``sys.executable`` is the small executable of
``tests/forked_python.py``, so Lightning's launcher starts the other ranks as ``[<it>, "-m",
"lightning_optim.train", *sys.argv[1:]]`` and those are forked from the zygote too (its docstring: what the
launcher sees; Lightning's ``rank_zero_only.rank`` and OMP_NUM_THREADS's threads are decided again from the
rank's environment). ``tests.distributed.run_torchrun`` runs torchrun here with ``PYTHON_EXEC`` set to it.
The zygote serves runs side by side (a launcher's run waits for its ranks). ``fork_launched=False``: the
launched ranks are fresh interpreters (``sys.executable`` is the real one).

What it does not give - keep ``subprocess.run`` where a test is about these:
  * anything else decided while modules are imported: the modules the zygote imported keep the zygote's
    state. An environment variable read at import (``PYTHONHASHSEED``, ``PYTHONIOENCODING``, ``PYTHONPATH``
    for those modules' location) has the zygote's value - the environment of this process when the zygote
    started, less PYTHONPATH/PYTHONWARNINGS; a warning an import would issue is issued in the zygote, not shown
    by the run; ``warnings`` filters that imports install are the zygote's.
  * import-time behaviour itself, packaging (which copy of a module gets imported), interpreter options.
  * interpreter teardown: objects still alive at exit are not finalized (no ``__del__`` of module globals,
    no C++ destructors); ``atexit`` handlers and ``logging.shutdown`` do run.
  * the zygote's random state is shared: the hash seed, and numpy's global generator until the job seeds it.
  * extra modules: ``tests.zygote`` and the ones the zygote imported are in ``sys.modules`` before the run starts.

The zygote itself (its request loop and what a forked child does to become the command): ``tests/zygote.py``.
"""

from __future__ import annotations

import atexit
import errno
import json
import locale
import os
import selectors
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

from tests.forked_python import RUN_ENV, SOCKET_ENV
from tests.zygote import MESSAGE_BYTES, kill_group

JOB = "lightning_optim.train"
REPO_ROOT = Path(__file__).resolve().parents[1]
# Start-up of the zygote itself (its imports) may take long on a busy machine; not counted in a run's timeout.
ZYGOTE_START_TIMEOUT_S = 600


def run_cli(args: list[str], *, cwd: str | os.PathLike, env: dict[str, str] | None = None,
            timeout: float = 240) -> subprocess.CompletedProcess:
    """``python -m lightning_optim.train *args`` forked from the zygote; as ``subprocess.run(...,
    capture_output=True, text=True)`` of that command would return (``args`` is that command)."""
    return run_module(JOB, args, cwd=cwd, env=env, timeout=timeout)


def run_module(module: str, args: list[str], *, cwd: str | os.PathLike, env: dict[str, str] | None = None,
               timeout: float = 240, fork_launched: bool = True) -> subprocess.CompletedProcess:
    """``python -m <module> *args`` forked from the zygote (any module: the harness tests run probes).

    ``fork_launched``: the run's ``sys.executable`` is ``tests.forked_python``'s executable, so the ranks a
    launcher in it starts from ``sys.executable`` (Lightning's) are forked from the zygote too; False: they
    are fresh interpreters."""
    command = [sys.executable, "-m", module, *args]
    if not os.path.isdir(cwd):  # as subprocess.run fails, before anything starts
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(cwd))
    zygote = _zygote()
    request = {"module": module, "args": list(args), "cwd": os.path.abspath(cwd),
               "env": dict(os.environ if env is None else env)}
    if fork_launched:
        request["executable"] = zygote.python
        request["env"][SOCKET_ENV] = zygote.socket_path
    return zygote.run(request, command, timeout)


def forked_python() -> str:
    """The executable that starts ``python [-u] script|-m module ...`` forked from the zygote
    (``tests/forked_python.py``): torchrun's ``PYTHON_EXEC`` in ``tests.distributed.run_torchrun``."""
    return _zygote().python


def forked_python_environment() -> dict[str, str]:
    """What a process started as :func:`forked_python` outside a run (the pool's fork server) needs in its
    environment to reach the zygote (a run's launched ranks get it from the run)."""
    return {SOCKET_ENV: _zygote().socket_path}


def set_by_imports() -> dict[str, str]:
    """The environment variables the zygote's imports set (Lightning's, say): a forked run has them unless its
    environment sets them, as a fresh interpreter that imports the same modules would."""
    return dict(_zygote().set_by_imports)


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
        serve = f"__import__('tests.zygote', fromlist=['serve']).serve({theirs.fileno()}, {sys_path!r})"
        self._process = subprocess.Popen(
            [sys.executable, "-c", serve], cwd=REPO_ROOT, env=_zygote_environment(),
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log, pass_fds=[theirs.fileno()])
        theirs.close()
        self.pid = self._process.pid
        ready = self._receive(time.monotonic() + ZYGOTE_START_TIMEOUT_S)
        if not ready or not ready.get("ready"):
            self._process.kill()
            raise self._failure(f"did not start within {ZYGOTE_START_TIMEOUT_S} s")
        self.python, self.socket_path = ready["python"], ready["socket"]  # for tests.forked_python
        self.set_by_imports: dict[str, str] = ready["set_by_imports"]

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
            if SOCKET_ENV in request["env"]:  # the ranks its launchers start say whose they are
                request["env"] = {**request["env"], RUN_ENV: str(self._requests)}
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
                try:
                    self._socket.send(json.dumps({"done": request["id"]}).encode())  # its launched ranks go too
                except OSError:  # the zygote is gone (and its children with their clients)
                    pass

    def _fork(self, request: dict[str, Any], fds: list[int]) -> int:
        message = json.dumps(request).encode()
        if len(message) > MESSAGE_BYTES:
            raise ValueError(f"the command line and environment take {len(message)} bytes, more than {MESSAGE_BYTES}")
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
                kill_group(pid)
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
        message = self._socket.recv(MESSAGE_BYTES)
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


def _text(data: bytes) -> str:
    """As ``subprocess.run(..., text=True)`` decodes: the locale's encoding, universal newlines."""
    return data.decode(locale.getpreferredencoding(False)).replace("\r\n", "\n").replace("\r", "\n")
