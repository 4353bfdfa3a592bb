"""The zygote of ``tests/cli.py``: an interpreter that imported ``PRELOAD`` once and forks a child per request,
the child becoming ``python -m <module> <args>`` (or ``python <script> <args>``). What a forked child gives and
lacks: ``tests/cli.py``'s docstring; the stand-in that launchers run as ``python``: ``tests/forked_python.py``.

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
import json
import os
import runpy
import selectors
import shutil
import signal
import socket
import sys
import tempfile
import threading
import traceback
import types
import warnings
from pathlib import Path
from typing import Any, NoReturn

from tests.forked_python import FORK_SERVER_CODE, RUN_ENV

# What the zygote imports before it forks: the job imports everything it needs at import time; the ranks
# torchrun starts (tests.distributed.run_torchrun) import Accelerate, the HF Trainer and GPT-2; the fork server of
# tests.worker_pool (forked from here too) preloads tests.worker_pool, lightning-optim and Lightning.
PRELOAD = ("lightning_optim.train", "accel_plugins.accelerate", "accel_plugins.hf",
           "transformers.models.gpt2.modeling_gpt2", "tests.worker_pool")
REPO_ROOT = Path(__file__).resolve().parents[1]
MESSAGE_BYTES = 1 << 20  # one request: the command line and the environment


def kill_group(pid: int) -> None:
    """SIGKILL the run's process group: the job and every process it started (Lightning's other ranks)."""
    for kill in (os.killpg, os.kill):  # os.kill: the group may not exist yet (a run interrupted at once)
        try:
            kill(pid, signal.SIGKILL)
            return
        except ProcessLookupError:
            continue



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
                    message, fds, _, _ = socket.recv_fds(self.client, MESSAGE_BYTES, 2)
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
        message, fds, _, _ = socket.recv_fds(connection, MESSAGE_BYTES, 5)  # stdio (+ a fork server's two)
        if message:
            request = json.loads(message)
            pid = self._start(request, fds, connection)
            self.launched[pid] = (connection, request["env"].get(RUN_ENV, ""))
            return
        for pid, (theirs, _) in self.launched.items():
            if theirs is connection:
                kill_group(pid)  # reaped when its exit is seen
        self._forget(connection)

    def _start(self, request: dict[str, Any], fds: list[int], reply_to: socket.socket) -> int:
        pid = os.fork()
        if pid == 0:
            for key in list(self.selector.get_map().values()):  # the zygote's sockets and pidfds: not the child's
                if isinstance(key.fileobj, socket.socket):
                    key.fileobj.close()
                else:
                    os.close(key.fd)
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
                kill_group(pid)

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
    """Become ``python -m <module> <args>`` (or ``python <script> <args>``, or multiprocessing's fork server),
    run it and exit; never returns into the zygote's loop."""
    code, interrupted = 1, False
    try:
        os.setpgid(0, 0)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _redirect_stdio(fds[:3])
        env = request["env"]
        os.environ.clear()
        os.environ.update({**set_by_imports, **env})  # what the imports set, where the run does not set it
        os.chdir(request["cwd"])
        script = request.get("script")
        sys.path[:] = _fresh_sys_path(env, startup_path, os.path.dirname(os.path.realpath(script)) if script else None)
        sys.executable = request.get("executable") or sys.executable
        _apply_warning_options(env.get("PYTHONWARNINGS", ""), startup_filters)
        flags = request.get("flags", [])
        unbuffered = bool(env.get("PYTHONUNBUFFERED")) or "-u" in flags
        _set_buffering(unbuffered)
        sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE")) or "-B" in flags
        _decide_again_what_imports_decided(env)
        if script:
            code, interrupted = _run_script_as_main(script, request["args"], flags)
        elif "code" in request:
            sys.path[0] = ""  # as -c has it
            code, interrupted = _run_fork_server(request["code"], request["args"], flags, fds[3:])
        else:
            code, interrupted = _run_as_main(request["module"], request["args"], flags)
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


def _run_as_main(module: str, args: list[str], flags: list[str]) -> tuple[int, bool]:
    """Run the module as ``python -m`` does; (exit status, whether an uncaught KeyboardInterrupt ended it)."""
    _forget_preloaded(module)
    sys.argv = ["-m", *args]  # as during -m's search; runpy sets argv[0] to the module's file
    sys.orig_argv = [sys.executable, *flags, "-m", module, *args]
    return _ran(lambda: runpy._run_module_as_main(module, alter_argv=True))


def _run_script_as_main(script: str, args: list[str], flags: list[str]) -> tuple[int, bool]:
    """Run the file as ``python <script>`` does; (exit status, whether an uncaught KeyboardInterrupt ended it)."""
    sys.argv = [script, *args]
    sys.orig_argv = [sys.executable, *flags, script, *args]
    return _ran(lambda: runpy.run_path(script, run_name="__main__"), lambda code: code.co_filename == script)


def _run_fork_server(code: str, args: list[str], flags: list[str], inherited: list[int]) -> tuple[int, bool]:
    """multiprocessing's fork server as ``python -c <code>`` runs it (``__main__`` a new module, argv ``-c``),
    its listening socket and alive pipe this child's copies of the launcher's: the code names them by number."""
    listener, alive = inherited
    for fd in inherited:
        os.set_inheritable(fd, True)  # as passed to a new interpreter
    call = code[len(FORK_SERVER_CODE):].split(",", 2)[2]  # after the launcher's two numbers
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    sys.argv = ["-c", *args]
    sys.orig_argv = [sys.executable, *flags, "-c", code, *args]
    body = compile(f"{FORK_SERVER_CODE}{listener}, {alive},{call}", "<string>", "exec")
    return _ran(lambda: exec(body, vars(main)), lambda frame_code: frame_code is body)


def _ran(run, is_first=None) -> tuple[int, bool]:
    """(exit status, whether an uncaught KeyboardInterrupt ended it) of ``run()``, as the interpreter ends."""
    try:
        run()
    except SystemExit as exit:
        return _exit_status(exit.code), False
    except BaseException as error:
        _print_uncaught(error, is_first)
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
