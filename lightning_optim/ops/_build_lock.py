"""Take turns building in one directory, so that a killed build can never make later ones hang.

``torch.utils.cpp_extension.load`` serialises builds with a plain lock file, ``<build dir>/lock``
(torch's FileBaton): created with O_EXCL, removed in a ``finally``. A build stopped by SIGTERM or
SIGKILL (and Ctrl-C in an unlucky moment) leaves it, and every later ``load()`` there polls for it
forever, silently. ``build_lock`` puts our own lock around ``load()``: an flock on
``<build dir>/build.lock``, which the OS drops when its holder dies, so it cannot go stale. Only a
holder of that lock builds there, so while we hold it a torch lock file is a dead build's leftover:
it is removed (said on stderr) and ``load()`` never waits on it. Waiting for a live build is
bounded (``LIGHTNING_OPTIM_BUILD_WAIT_S``) and says whom it waits for.

Where flock is missing (Windows, some network file systems) we wait, bounded, for torch's lock file
to go away and otherwise name it in the error.
"""

from __future__ import annotations

import math
import os
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]  # the name stays, as None: no lock there

LOCK_FILE = "build.lock"  # ours: an flock, dropped by the OS when its holder dies
BATON_FILE = "lock"  # torch's FileBaton inside load()
WAIT_ENV = "LIGHTNING_OPTIM_BUILD_WAIT_S"
DEFAULT_WAIT_S = 1200.0  # a CUDA build takes ~4 min on 2 idle cores, a few times that on a loaded machine
POLL_S = 0.2
# What a build runs in its directory: ninja, compilers, assembler, linker (plus the basename of $CXX).
BUILD_TOOLS = frozenset({"ninja", "c++", "g++", "gcc", "cc", "cc1", "cc1plus", "as", "ld", "collect2", "lto1",
                         "lto-wrapper", "clang", "clang++", "nvcc", "cicc", "ptxas", "fatbinary", "nvlink",
                         "cudafe++"})


class BuildError(RuntimeError):
    """The extension could not be built or loaded; the message says why."""


def build_wait_s() -> float:
    """How long to wait for another process's build: ``LIGHTNING_OPTIM_BUILD_WAIT_S`` or the default."""
    raw = os.environ.get(WAIT_ENV, "").strip()
    if not raw:
        return DEFAULT_WAIT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not value >= 0:  # also NaN
        raise BuildError(f"{WAIT_ENV}={raw!r} is not a number of seconds >= 0 (unset: {DEFAULT_WAIT_S:.0f})")
    return value


class _Bound:
    """The time left for all the waits of one build_lock."""

    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s
        self.deadline = time.monotonic() + wait_s

    def passed(self) -> bool:
        return time.monotonic() >= self.deadline

    def left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def setting(self) -> str:
        return f"{WAIT_ENV} sets how many seconds to wait (now {self.wait_s:g})"


@contextmanager
def build_lock(build_dir: Path, wait_s: float | None = None) -> Iterator[None]:
    """Hold the right to build in ``build_dir`` (created if missing) for the ``with`` block.

    Waits at most ``wait_s`` (default ``build_wait_s()``) for a live build there, then raises
    BuildError naming the lock file and the remedy. Inside the block no torch lock file is left.
    """
    build_dir.mkdir(parents=True, exist_ok=True)
    bound = _Bound(build_wait_s() if wait_s is None else wait_s)
    fd = _acquire(build_dir / LOCK_FILE, bound)
    try:
        if fd is None:
            _wait_for_baton(build_dir / BATON_FILE, bound)
        else:
            _wait_for_leftovers(build_dir, bound)
            _remove_stale_baton(build_dir / BATON_FILE)
        yield
    finally:
        if fd is not None:
            os.close(fd)  # drops the flock; the file stays (unlinking it would race with waiters)


def _acquire(path: Path, bound: _Bound) -> int | None:
    """The descriptor holding the flock on ``path`` (our pid written in it), or None where flock is
    unavailable. Raises BuildError once ``bound`` passes while a live process holds it."""
    if fcntl is None:
        return None
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        announced = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                announced = _wait_turn(path, bound, announced)
            except OSError:  # ENOLCK/EOPNOTSUPP: a file system without locks
                os.close(fd)
                return None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        return fd
    except BaseException:
        os.close(fd)
        raise


def _wait_turn(path: Path, bound: _Bound, announced: bool) -> bool:
    """One poll of the wait for the holder of ``path``: say once whom we wait for, fail past ``bound``."""
    holder = _holder(path)
    if bound.passed():
        raise BuildError(
            f"gave up waiting for the kernel build lock {path}, held by pid {holder}: let that build finish, "
            f"or stop that process if it is stuck, then retry; {bound.setting()}")
    if not announced:
        print(f"lightning-optim: waiting for the kernel build of pid {holder} (lock {path}; up to "
              f"{bound.left():.0f} s more, {WAIT_ENV} sets that)...", file=sys.stderr, flush=True)
    time.sleep(POLL_S)
    return True


def _holder(path: Path) -> str:
    """The pid the lock's holder wrote into it ("unknown" while it is being written)."""
    try:
        return path.read_text().strip() or "unknown"
    except OSError:
        return "unknown"


def _remove_stale_baton(baton: Path) -> None:
    """Remove torch's lock file, which only a killed build can have left while we hold our lock."""
    try:
        baton.unlink()
    except FileNotFoundError:
        return
    print(f"lightning-optim: removed {baton}, left by a kernel build that was stopped; building again",
          file=sys.stderr, flush=True)


def _wait_for_baton(baton: Path, bound: _Bound) -> None:
    """Without flock: wait within ``bound`` for torch's lock file to go, then fail naming it."""
    announced = False
    while baton.exists():
        if bound.passed():
            raise BuildError(
                f"{baton} still exists: another process is building the kernels, or a build was stopped and "
                f"left it. If no build is running, delete {baton} and retry; {bound.setting()}")
        if not announced:
            print(f"lightning-optim: waiting for {baton} to go (another kernel build)...", file=sys.stderr, flush=True)
            announced = True
        time.sleep(POLL_S)


def _wait_for_leftovers(build_dir: Path, bound: _Bound) -> None:
    """Wait within ``bound`` for the compilers of a killed build to end.

    Killing only the Python process of a build leaves ninja and the compilers it started running,
    writing the same object files that our build is about to write.
    """
    announced = False
    while pids := leftover_builders(build_dir):
        if bound.passed():
            raise BuildError(
                f"processes {pids} left by a stopped kernel build still run in {build_dir}: wait for them or "
                f"stop them (kill {' '.join(map(str, pids))}), then retry; {bound.setting()}")
        if not announced:
            print(f"lightning-optim: waiting for processes {pids} left by a stopped kernel build in {build_dir}...",
                  file=sys.stderr, flush=True)
            announced = True
        time.sleep(POLL_S)


def leftover_builders(build_dir: Path) -> list[int]:
    """Pids of build tools working in ``build_dir`` (Linux /proc; [] elsewhere). Called while holding our
    lock, these belong to a killed build."""
    proc = Path("/proc")
    if not (proc / "self" / "cwd").exists():
        return []
    target = os.path.realpath(build_dir)
    tools = BUILD_TOOLS | {os.path.basename(os.environ.get("CXX", "c++"))}
    found = []
    for entry in os.scandir(proc):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if os.readlink(f"{entry.path}/cwd") != target:
                continue
            names = {(proc / entry.name / "comm").read_text().strip(),
                     os.path.basename((proc / entry.name / "cmdline").read_bytes().split(b"\0")[0].decode())}
        except (OSError, UnicodeDecodeError):  # gone meanwhile, or another user's
            continue
        if any(_is_tool(name, tools) for name in names):
            found.append(int(entry.name))
    return sorted(found)


def _is_tool(name: str, tools: frozenset[str] | set[str]) -> bool:
    """``name`` is a build tool, also as ``g++-12``, ``x86_64-linux-gnu-g++`` or ``ld.gold``."""
    return name in tools or any(part in tools for part in re.split(r"[-.]", name))
