"""The ``python`` that launchers run in the tests: a rank forked from this pytest process's zygote (tests/cli.py).

A launcher starts its ranks as ``<python> -u script.py args`` (torchrun; its ``PYTHON_EXEC`` names the
interpreter) or ``<python> -m module args`` (Lightning's launcher: ``sys.executable`` of rank 0);
multiprocessing starts its fork server as ``<python> [-B] -c "from multiprocessing.forkserver import main; ..."``
with two inherited descriptors (``tests.worker_pool`` points it here, passed on to the zygote). When that
``<python>`` is the small executable :func:`write_executable` writes, the command runs this module's
:func:`main` instead of a new interpreter: it asks the zygote (over the Unix socket named by ``SOCKET_ENV`` in
its environment) to fork a child that becomes that command - with this client's stdin/stdout/stderr, its
environment and cwd - and then stands in for it towards the launcher:

* it is the launcher's child, so the launcher's ``Popen`` waits on it, polls it and signals it as it would the
  interpreter; signals it gets (SIGTERM, SIGINT, ...) are passed to the rank's process group;
* its exit status is the rank's (a rank killed by a signal: the client kills itself with that signal);
* if it dies itself (SIGKILL), the zygote kills the rank; when the test's run ends the zygote kills any rank it
  forked for that run that is still alive (``RUN_ENV``), as ``tests.cli`` kills "the run and what it started".

What a forked rank gives and lacks is what ``tests.cli``'s forked runs give and lack (its docstring); the two
import-time decisions that differ between ranks of one launch - Lightning's ``rank_zero_only.rank`` (from
RANK/LOCAL_RANK) and the intra-op threads (torchrun's ``OMP_NUM_THREADS=1``) - are made again from the rank's
environment. A command line this client does not handle (anything but ``[-u] [-B] -m module ...``,
``[-u] [-B] script ...`` and the fork server's) or a zygote that cannot be reached runs the real interpreter
instead (``os.execv``): never a wrong run, at worst a slower one. So does the rank ``FRESH_RANK_ENV`` names
(``RANK``): a launch with one rank started as a user's shell starts it.

Stdlib only: the executable starts this module with ``python -S`` (no site-packages: ~20 ms).
"""

from __future__ import annotations

import ast
import json
import os
import signal
import socket
import sys
from pathlib import Path

SOCKET_ENV = "LIGHTNING_OPTIM_TEST_ZYGOTE_SOCKET"  # where the zygote takes launched ranks' requests
RUN_ENV = "LIGHTNING_OPTIM_TEST_ZYGOTE_RUN"  # which test run a launched rank belongs to (killed with it)
FRESH_RANK_ENV = "LIGHTNING_OPTIM_TEST_FRESH_RANK"  # the rank (RANK) that runs the real interpreter instead
# How multiprocessing starts its fork server (Python 3.10-3.13: ``-c`` with the listener's and the alive pipe's fds)
FORK_SERVER_CODE = "from multiprocessing.forkserver import main; main("
_FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
_MESSAGE_BYTES = 1 << 20


def write_executable(folder: Path, real_python: str, repo_root: Path) -> Path:
    """An executable ``folder/python`` that runs :func:`main` (the launcher's view: an interpreter)."""
    path = folder / "python"
    path.write_text(f"#!{real_python} -S\n"
                    "import sys\n"
                    f"sys.path.insert(0, {str(repo_root)!r})\n"
                    "from tests.forked_python import main\n"
                    f"main({real_python!r}, sys.argv[1:])\n")
    path.chmod(0o755)
    return path


def parse_command(argv: list[str]) -> dict | None:
    """``[-u] [-B] (-m module | script) args...`` as a request ({"module"|"script", "args", "flags"}), and
    multiprocessing's fork server (``[-B] -c "<FORK_SERVER_CODE>..."``: {"code", "args", "flags", "inherit": the
    two descriptors its code names}); None for any other command line."""
    rest = list(argv)
    flags = []
    while rest and rest[0] in ("-u", "-B"):
        flags.append(rest.pop(0))
    request = {"flags": flags}
    if len(rest) >= 2 and rest[0] == "-m":
        return {**request, "module": rest[1], "args": rest[2:]}
    if len(rest) >= 2 and rest[0] == "-c" and rest[1].startswith(FORK_SERVER_CODE):
        inherit = _fork_server_descriptors(rest[1])
        return None if inherit is None else {**request, "code": rest[1], "args": rest[2:], "inherit": inherit}
    if rest and not rest[0].startswith("-"):
        return {**request, "script": os.path.abspath(rest[0]), "args": rest[1:]}
    return None


def _fork_server_descriptors(code: str) -> list[int] | None:
    """The listener's and the alive pipe's descriptors of ``main(listener, alive, preload, **{main_path,
    sys_path})``; None for a call of another shape (another Python's fork server passes more)."""
    try:
        call = ast.parse(code).body[-1].value
        listener, alive, _ = (ast.literal_eval(arg) for arg in call.args)
        (keywords,) = call.keywords
        extra = ast.literal_eval(keywords.value) if keywords.arg is None else None
    except (SyntaxError, ValueError, AttributeError, TypeError):
        return None
    if not (type(listener) is int and type(alive) is int and isinstance(extra, dict)
            and set(extra) <= {"main_path", "sys_path"}):
        return None
    return [listener, alive]


def main(real_python: str, argv: list[str]) -> None:
    request = parse_command(argv)
    path = os.environ.get(SOCKET_ENV)
    fresh_rank = os.environ.get(FRESH_RANK_ENV)
    if request is None or not path or (fresh_rank is not None and fresh_rank == os.environ.get("RANK")):
        _exec_real(real_python, argv)
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        connection.connect(path)
    except OSError:  # the zygote is gone (its test session ended): a real interpreter
        _exec_real(real_python, argv)
    request.update(cwd=os.getcwd(), env=dict(os.environ))
    if "code" not in request:  # a rank: its launcher's view of the interpreter (the fork server keeps the real one)
        request["executable"] = os.path.abspath(sys.argv[0])
    socket.send_fds(connection, [json.dumps(request).encode()], [0, 1, 2, *request.get("inherit", [])])
    pid = _receive(connection)["pid"]
    for name in _FORWARDED:
        signal.signal(getattr(signal, name), lambda signum, frame: _pass_on(pid, signum))
    returncode = _receive(connection)["returncode"]
    if returncode < 0:  # the rank was killed by a signal: so is its stand-in
        try:
            signal.signal(-returncode, signal.SIG_DFL)
        except (OSError, ValueError):  # SIGKILL, SIGSTOP: no handler to take back
            pass
        os.kill(os.getpid(), -returncode)
        returncode = 128 - returncode
    os._exit(returncode)


def _receive(connection: socket.socket) -> dict:
    message = connection.recv(_MESSAGE_BYTES)
    if not message:
        sys.stderr.write("tests.forked_python: the zygote closed the connection\n")
        os._exit(1)
    return json.loads(message)


def _pass_on(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)  # the rank leads its own process group (and what it started is in it)
    except ProcessLookupError:
        pass


def _exec_real(real_python: str, argv: list[str]) -> None:
    os.execv(real_python, [real_python, *argv])
