"""Run ``python -m lightning_optim.train ...`` (and torchrun, and the ranks launchers start) for a test without
paying the interpreter start-up each time.

Importing the job (torch, Lightning, Hydra, matplotlib) costs ~7 s of CPU per fresh interpreter, a rank of the
HF scripts ~10 s. ``run_cli`` instead forks the run from a *zygote*: one helper interpreter per pytest process
(per xdist worker), started on first use, that imported ``PRELOAD`` once and then forks a child per call. The
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
  * extra modules: ``tests.cli`` and the ones the zygote imported are in ``sys.modules`` before the run starts.

Fork safety: the zygote only imports, never computes (no torch thread pool, no ``torch.distributed``, no
CUDA); the two OpenBLAS pools numpy and scipy start at import stop themselves before every fork (their
``pthread_atfork`` handlers), so the zygote is single-threaded when it forks.

Why not multiprocessing's "forkserver" with ``set_forkserver_preload``: its child is a multiprocessing child
(``current_process()`` is "Process-N", ``parent_process()`` is set, the default start method is forced to
forkserver, so DataLoader workers would go through it too), ``spawn.prepare`` replaces sys.path/argv/cwd and
may re-run the pytest script as ``__mp_main__``, Python 3.11's forkserver ignores the sys.path it is given for
the preload (an ImportError there is silently skipped), and there is one forkserver per process for everyone.
The zygote here is a plain interpreter with a small request loop over a Unix socket pair (``socket.send_fds``
passes the run's stdout/stderr pipes) and a listening Unix socket for the launched ranks' stand-ins.
"""

from __future__ import annotations

import atexit
import errno
import json
import locale
import os
import runpy
import selectors
import shutil
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

from tests.forked_python import RUN_ENV, SOCKET_ENV

JOB = "lightning_optim.train"
# What the zygote imports before it forks: the job imports everything it needs at import time; the ranks
# torchrun starts (tests.distributed.run_torchrun) import Accelerate, the HF Trainer and GPT-2.
PRELOAD = (JOB, "accel_plugins.accelerate", "accel_plugins.hf", "transformers.models.gpt2.modeling_gpt2")
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
        serve = f"__import__('tests.cli', fromlist=['serve']).serve({theirs.fileno()}, {sys_path!r})"
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
    """The zygote's main loop: import ``PRELOAD``, then fork one child per request - the test's runs (over
    ``sock_fd``) and the ranks their launchers start through ``tests.forked_python`` (over a Unix socket) - until
    the client leaves. Runs go on side by side: each child's exit is reported when it happens."""
    startup_path = sys.path[1:]  # what any interpreter starts with, less -c's "" (PYTHONPATH is unset here)
    startup_filters = list(warnings.filters)  # the interpreter's defaults: no PYTHONWARNINGS here either
    sys.path[:] = json.loads(parent_sys_path)  # import what the tests import
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C is for pytest; it closes the socket and we stop
    environ = dict(os.environ)
    for module in PRELOAD:
        __import__(module)
    set_by_imports = {k: v for k, v in os.environ.items() if environ.get(k) != v}  # torch's, Lightning's defaults
    from tests.forked_python import write_executable  # noqa: PLC0415 - the zygote's alone

    place = Path(tempfile.mkdtemp(prefix="lightning-optim-zygote-"))
    try:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(str(place / "socket"))
        listener.listen(64)
        python = write_executable(place, sys.executable, REPO_ROOT)
        client = socket.socket(fileno=sock_fd)
        client.send(json.dumps({"ready": True, "python": str(python), "socket": str(place / "socket"),
                                "set_by_imports": set_by_imports}).encode())
        _Server(client, listener, (startup_path, startup_filters, set_by_imports)).loop()
    finally:
        shutil.rmtree(place, ignore_errors=True)


class _Server:
    """The zygote's bookkeeping: which child answers to whom, and which launched ranks belong to which run."""

    def __init__(self, client: socket.socket, listener: socket.socket, startup: tuple) -> None:
        self.client, self.listener = client, listener
        self.startup = startup  # (sys.path and warning filters at start-up, the variables imports set)
        self.selector = selectors.DefaultSelector()
        self.selector.register(client, selectors.EVENT_READ, ("client", None))
        self.selector.register(listener, selectors.EVENT_READ, ("listener", None))
        self.launched: dict[int, tuple[socket.socket, str]] = {}  # pid -> (its client's connection, its run)

    def loop(self) -> None:
        while True:
            for key, _ in self.selector.select():
                kind, item = key.data
                if kind == "client":
                    message, fds, _, _ = socket.recv_fds(self.client, _MESSAGE_BYTES, 2)
                    if not message:
                        return
                    request = json.loads(message)
                    if "done" in request:  # the test is done with a run: nothing it started may outlive it
                        self._kill_launched(str(request["done"]))
                    else:
                        self._start(request, fds, self.client)
                elif kind == "listener":
                    connection, _ = self.listener.accept()
                    self.selector.register(connection, selectors.EVENT_READ, ("launched", connection))
                elif kind == "launched":
                    self._launched_request(item)
                else:
                    self._reap(*item)

    def _launched_request(self, connection: socket.socket) -> None:
        """A ``tests.forked_python`` client: its one request, or end of file (it died: so does its rank)."""
        message, fds, _, _ = socket.recv_fds(connection, _MESSAGE_BYTES, 3)
        if message:
            request = json.loads(message)
            pid = self._start(request, fds, connection)
            self.launched[pid] = (connection, request["env"].get(RUN_ENV, ""))
            return
        for pid, (theirs, _) in self.launched.items():
            if theirs is connection:
                _kill_group(pid)  # reaped when its exit is seen
        self._forget(connection)

    def _start(self, request: dict[str, Any], fds: list[int], reply_to: socket.socket) -> int:
        pid = os.fork()
        if pid == 0:
            for key in list(self.selector.get_map().values()):
                key.fileobj.close() if isinstance(key.fileobj, socket.socket) else os.close(key.fd)
            self.selector.close()
            _child(request, fds, *self.startup)
        _own_group(pid)
        for fd in fds:
            os.close(fd)
        pidfd = os.pidfd_open(pid)
        self.selector.register(pidfd, selectors.EVENT_READ, ("exit", (pidfd, pid, reply_to, request.get("id"))))
        reply_to.send(json.dumps({"id": request.get("id"), "pid": pid}).encode())
        return pid

    def _reap(self, pidfd: int, pid: int, reply_to: socket.socket, request_id: Any) -> None:
        self.selector.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        launched = self.launched.pop(pid, None)
        try:
            reply_to.send(json.dumps({"id": request_id, "returncode": os.waitstatus_to_exitcode(status)}).encode())
        except OSError:  # a launched rank's client that is gone
            pass
        if launched is not None:
            self._forget(launched[0])

    def _kill_launched(self, run: str) -> None:
        for pid, (_, theirs) in self.launched.items():
            if theirs == run:
                _kill_group(pid)

    def _forget(self, connection: socket.socket) -> None:
        if connection.fileno() >= 0:  # not closed already (its client left before its rank ended)
            self.selector.unregister(connection)
            connection.close()


def _own_group(pid: int) -> None:
    """The child's own process group, set from both sides so it exists before the client learns the pid."""
    try:
        os.setpgid(pid, pid)
    except OSError:  # the child already did it (and may have started something), or it is gone
        pass


# ------------------------------------------------------------------------------------------------- the child
def _child(request: dict[str, Any], fds: list[int], startup_path: list[str], startup_filters: list[Any],
           set_by_imports: dict[str, str]) -> NoReturn:
    """Become ``python -m <module> <args>`` (or ``python <script> <args>``), run it and exit; never returns
    into the zygote's loop."""
    code, interrupted = 1, False
    try:
        os.setpgid(0, 0)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _redirect_stdio(fds)
        env = request["env"]
        os.environ.clear()
        os.environ.update({**set_by_imports, **env})  # what the imports set, where the run does not set it
        os.chdir(request["cwd"])
        script = request.get("script")
        sys.path[:] = _fresh_sys_path(env, startup_path, os.path.dirname(os.path.realpath(script)) if script else None)
        sys.executable = request.get("executable") or sys.executable
        _apply_warning_options(env.get("PYTHONWARNINGS", ""), startup_filters)
        unbuffered = bool(env.get("PYTHONUNBUFFERED")) or request.get("unbuffered", False)
        _set_buffering(unbuffered)
        _decide_again_what_imports_decided(env)
        if script:
            code, interrupted = _run_script_as_main(script, request["args"], unbuffered)
        else:
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


def _redirect_stdio(fds: list[int]) -> None:
    """fds 0-2: the launched rank's client's three, or ``capture_output``'s two pipes (stdin: /dev/null);
    inherited by whatever the run starts."""
    _flush_stdio()  # nothing of the zygote's may reach the run's output
    if len(fds) == 2:
        fds = [os.open(os.devnull, os.O_RDONLY), *fds]
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)


def _decide_again_what_imports_decided(env: dict[str, str]) -> None:
    """The import-time decisions that differ between the ranks of one launch, made again from this run's
    environment (the zygote made them from its own): Lightning's ``rank_zero_only.rank`` (RANK, LOCAL_RANK,
    ...) and the intra-op threads OpenMP took from ``OMP_NUM_THREADS`` (torchrun gives its ranks 1)."""
    rank_zero = sys.modules.get("lightning.fabric.utilities.rank_zero")
    if rank_zero is not None:
        rank_zero.rank_zero_only.rank = rank_zero._get_rank() or 0  # what its import does in a new process
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))


def _fresh_sys_path(env: dict[str, str], startup_path: list[str], script_dir: str | None = None) -> list[str]:
    """The interpreter's sys.path: the script's folder (``python -m``: the cwd), then PYTHONPATH's entries
    (absolute), then the standard ones."""
    pythonpath = env.get("PYTHONPATH", "")
    extra = [os.path.abspath(entry) for entry in pythonpath.split(os.pathsep)] if pythonpath else []
    return [script_dir or os.getcwd(), *extra, *startup_path]


def _apply_warning_options(pythonwarnings: str, startup_filters: list[Any]) -> None:
    """PYTHONWARNINGS's filters where start-up puts them: above the defaults, below any filter an import put
    on top (an import's ``append=True`` filters stay below the defaults)."""
    options = [option for option in pythonwarnings.split(",") if option]
    sys.warnoptions[:] = options
    if not options:
        return
    filters = warnings.filters
    n = len(startup_filters)
    found = [i for i in range(len(filters) - n, -1, -1) if filters[i:i + n] == startup_filters]
    boundary = found[0] if found else 0  # 0: an import rearranged the defaults: the options go on top
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


def _run_script_as_main(script: str, args: list[str], unbuffered: bool) -> tuple[int, bool]:
    """Run the file as ``python <script>`` does; (exit status, whether an uncaught KeyboardInterrupt ended it)."""
    sys.argv = [script, *args]
    sys.orig_argv = [sys.executable, *(["-u"] if unbuffered else []), script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit:
        return _exit_status(exit.code), False
    except BaseException as error:
        _print_uncaught(error, lambda code: code.co_filename == script)
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


def _print_uncaught(error: BaseException, is_first=None) -> None:
    """``sys.excepthook`` from the interpreter's own first frame (``python -m``: runpy's; a script: the
    script's), not from this harness's frames."""
    main_code = runpy._run_module_as_main.__code__
    is_first = is_first or (lambda code: code is main_code)
    tb = error.__traceback__
    while tb is not None and not is_first(tb.tb_frame.f_code):
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
