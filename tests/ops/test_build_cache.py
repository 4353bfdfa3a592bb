"""The kernel build: a killed build never makes a later one hang, and the cache
directory is keyed by the kernel sources and the build configuration.

The kill tests kill a real ``torch.utils.cpp_extension.load`` of a tiny C++ module run inside
``build_lock``, the function ``_build`` runs ours in (checked below). A compiler wrapper holds each
compile until the test lets it go, so every kill lands mid-build and no assertion depends on timing;
the waits below are bounds on a hang, never reached when things work.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch.utils.cpp_extension

from lightning_optim.ops import _build_lock, _loader
from lightning_optim.ops._build_lock import BATON_FILE, LOCK_FILE, WAIT_ENV, BuildError, build_lock

REPO = Path(__file__).resolve().parents[2]
BOUND_S = 120  # the longest any wait here may take before the test fails as hung
POSIX = pytest.mark.skipif(_build_lock.fcntl is None or not hasattr(signal, "SIGKILL"),
                           reason="needs flock and POSIX signals")
LINUX_PROC = pytest.mark.skipif(not Path("/proc/self/cwd").exists(), reason="needs Linux /proc")

TINY_SOURCE = r"""
#include <Python.h>
static struct PyModuleDef lo_tiny_def = {PyModuleDef_HEAD_INIT, "lo_tiny", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit_lo_tiny(void) {
    PyObject* module = PyModule_Create(&lo_tiny_def);
    if (module != nullptr) PyModule_AddIntConstant(module, "answer", 42);
    return module;
}
"""

# ``build_lock`` in a child process without importing all of lightning_optim (the package's import is most
# of such a process's start-up; _build_lock needs only the standard library): the same file, by its path.
IMPORT_BUILD_LOCK = f"""
import importlib.util, sys
_spec = importlib.util.spec_from_file_location("_lo_build_lock", {str(Path(_build_lock.__file__))!r})
_module = sys.modules["_lo_build_lock"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
build_lock = _module.build_lock
"""

# One process building the tiny module as _build builds ours: load() inside build_lock.
TINY_BUILD = IMPORT_BUILD_LOCK + """
import sys
from pathlib import Path
from torch.utils.cpp_extension import load
build_dir, source = Path(sys.argv[1]), sys.argv[2]
with build_lock(build_dir):
    module = load(name="lo_tiny", sources=[source], build_directory=str(build_dir))
print("answer", module.answer, flush=True)
"""

# A compiler that logs each compile and holds it until the file $LO_GO exists (probes and links pass).
WRAPPER = """#!/bin/sh
case " $* " in
  *" -c "*) echo "$$" >> "$LO_COMPILES"; while [ ! -e "$LO_GO" ]; do sleep 0.05; done ;;
esac
exec {real} "$@"
"""


def _interruptible() -> None:
    """SIGINT back to its default in the child: a shell without job control starts background jobs (a CI
    step, ``cmd &``) with SIGINT ignored, the child would inherit that, and Python then installs no
    KeyboardInterrupt handler - the SIGINT case below would wait for a build that never stops."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@dataclass
class TinyBuild:
    """A tiny extension, a build directory for it and a gated compiler; starts builds in subprocesses."""

    root: Path
    env: dict[str, str]

    @property
    def build_dir(self) -> Path:
        return self.root / "build"

    @property
    def baton(self) -> Path:
        return self.build_dir / BATON_FILE

    def compiles(self) -> int:
        path = Path(self.env["LO_COMPILES"])
        return len(path.read_text().split()) if path.exists() else 0

    def release(self) -> None:
        Path(self.env["LO_GO"]).touch()

    def command(self) -> list[str]:
        return [sys.executable, "-c", TINY_BUILD, str(self.build_dir), str(self.root / "tiny.cpp")]

    def start(self, tag: str) -> subprocess.Popen:
        """A build in its own session (so its leftovers can be found and ended), output in files."""
        out = open(self.root / f"{tag}.out", "w")  # noqa: SIM115 (closed by the child's exit)
        err = open(self.root / f"{tag}.err", "w")  # noqa: SIM115
        return subprocess.Popen(self.command(), env=self.env, stdout=out, stderr=err, start_new_session=True,
                                preexec_fn=_interruptible)

    def stderr(self, tag: str) -> str:
        return (self.root / f"{tag}.err").read_text()

    def stdout(self, tag: str) -> str:
        return (self.root / f"{tag}.out").read_text()


@pytest.fixture
def tiny(tmp_path: Path) -> TinyBuild:
    missing = _loader._missing_tools()
    if missing:
        pytest.skip(f"no toolchain: {missing}")
    real = shutil.which(os.environ.get("CXX", "c++"))
    (tmp_path / "tiny.cpp").write_text(TINY_SOURCE)
    wrapper = tmp_path / "bin" / "g++"
    wrapper.parent.mkdir()
    wrapper.write_text(WRAPPER.format(real=real))
    wrapper.chmod(0o755)
    env = dict(os.environ, CXX=str(wrapper), LO_GO=str(tmp_path / "go"), LO_COMPILES=str(tmp_path / "compiles"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env[WAIT_ENV] = str(BOUND_S // 2)  # a wrong wait then ends in BuildError, before the subprocess bound
    return TinyBuild(tmp_path, env)


def wait_for(condition: Callable[[], bool], what: str, procs: Sequence[subprocess.Popen] = ()) -> None:
    """Poll ``condition``; fail if one of ``procs`` exits first or after BOUND_S (a hang)."""
    deadline = time.monotonic() + BOUND_S
    while not condition():
        ended = [p for p in procs if p.poll() is not None]
        if ended:
            pytest.fail(f"{what}: process {ended[0].pid} ended first (exit {ended[0].returncode})")
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: still not after {BOUND_S} s")
        time.sleep(0.05)


def end_session(proc: subprocess.Popen) -> None:
    """End what is left of a build we started (its ninja and compilers share its session id)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait(timeout=BOUND_S)


def held_elsewhere(lock_file: Path) -> bool:
    """Whether some open file description holds the flock on ``lock_file`` (a fresh one cannot take it)."""
    fd = os.open(lock_file, os.O_RDWR)
    try:
        _build_lock.fcntl.flock(fd, _build_lock.fcntl.LOCK_EX | _build_lock.fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


# --- a killed build -----------------------------------------------------------------------------

@POSIX
@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_killed_build_does_not_hang_the_next(tiny: TinyBuild, sig: signal.Signals):
    first = tiny.start("first")
    second = None
    try:
        wait_for(lambda: tiny.compiles() == 1, "the first build reaches the compiler", [first])
        assert tiny.baton.exists()  # inside load(), holding torch's lock
        first.send_signal(sig)
        first.wait(timeout=BOUND_S)
        if sig != signal.SIGINT:  # KeyboardInterrupt runs torch's finally; a SIGTERM/SIGKILL'ed build cannot
            assert tiny.baton.exists(), "the bug's precondition: torch's lock file is left behind"
        # The killed build's compiler still runs (held by the gate): the next build must wait for it.
        second = tiny.start("second")
        wait_for(lambda: "left by a stopped kernel build" in tiny.stderr("second"),
                 "the next build waits for the killed build's compiler", [second])
        assert tiny.compiles() == 1  # not compiling beside it
        tiny.release()
        code = second.wait(timeout=BOUND_S)
    finally:
        tiny.release()
        for proc in (first, second):
            if proc is not None:
                end_session(proc)
    assert code == 0, tiny.stderr("second")[-3000:]
    assert "answer 42" in tiny.stdout("second")
    if sig != signal.SIGINT:
        assert f"removed {tiny.baton}" in tiny.stderr("second")
    assert not tiny.baton.exists()


@POSIX
@pytest.mark.slow
def test_two_processes_build_once(tiny: TinyBuild):
    procs = {tag: tiny.start(tag) for tag in ("a", "b")}
    try:
        wait_for(lambda: tiny.compiles() == 1, "one build reaches the compiler", list(procs.values()))
        wait_for(lambda: any("waiting for the kernel build of pid" in tiny.stderr(t) for t in procs),
                 "the other build waits for it", list(procs.values()))
        waiter = next(t for t in procs if "waiting for the kernel build" in tiny.stderr(t))
        builder = next(t for t in procs if t != waiter)
        assert f"pid {procs[builder].pid}" in tiny.stderr(waiter)  # names whom it waits for
        tiny.release()
        codes = {tag: proc.wait(timeout=BOUND_S) for tag, proc in procs.items()}
    finally:
        tiny.release()
        for proc in procs.values():
            end_session(proc)
    assert codes == {"a": 0, "b": 0}, {t: tiny.stderr(t)[-2000:] for t in procs}
    assert all("answer 42" in tiny.stdout(t) for t in procs)
    assert tiny.compiles() == 1  # the waiter found the module built


HOLD = IMPORT_BUILD_LOCK + """
import sys
from pathlib import Path
with build_lock(Path(sys.argv[1])):
    sys.stdin.read()
"""


@POSIX
def test_wait_for_a_live_build_is_bounded(tmp_path: Path, monkeypatch, capsys):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdin=subprocess.PIPE)
    lock_file = tmp_path / LOCK_FILE
    try:
        wait_for(lambda: lock_file.exists() and lock_file.read_text().strip() == str(holder.pid),
                 "the holder takes the lock", [holder])
        monkeypatch.setenv(WAIT_ENV, "0.5")
        with pytest.raises(BuildError) as info, build_lock(tmp_path):
            pass
    finally:
        holder.stdin.close()
        holder.wait(timeout=BOUND_S)
    message = str(info.value)
    assert str(lock_file) in message and f"pid {holder.pid}" in message and WAIT_ENV in message
    assert f"waiting for the kernel build of pid {holder.pid}" in capsys.readouterr().err
    with build_lock(tmp_path, wait_s=0):  # free once its holder is gone
        assert held_elsewhere(lock_file)


@POSIX
def test_torch_lock_left_by_a_killed_build_is_removed_and_said(tmp_path: Path, capsys):
    baton = tmp_path / BATON_FILE
    baton.touch()
    with build_lock(tmp_path, wait_s=0):
        assert not baton.exists()
    assert f"removed {baton}" in capsys.readouterr().err


@POSIX
def test_real_build_runs_load_inside_build_lock(ext, tmp_path: Path, monkeypatch):
    """_build (what build() and ``python -m lightning_optim.ops build`` run) calls load() holding our lock
    on its build directory, with a dead build's torch lock file already gone."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    cuda = _loader.want_cuda()
    build_dir = _loader.build_root(cuda) / ("lightning_optim_kernels" + ("_cuda" if cuda else ""))
    build_dir.mkdir(parents=True)
    (build_dir / BATON_FILE).touch()
    seen = {}

    def fake_load(**kwargs):
        where = Path(kwargs["build_directory"])
        seen.update(dir=where, locked=held_elsewhere(where / LOCK_FILE), baton=(where / BATON_FILE).exists())
        return ext

    monkeypatch.setattr(torch.utils.cpp_extension, "load", fake_load)
    assert _loader._build(verbose=False) is ext
    assert seen == {"dir": build_dir, "locked": True, "baton": False}


@LINUX_PROC
@POSIX
def test_compilers_left_by_a_killed_build_are_waited_for(tmp_path: Path):
    """Killing only a build's Python process leaves its ninja and compilers writing object files."""
    build_dir, go = tmp_path / "build", tmp_path / "go"
    build_dir.mkdir()
    compiler = tmp_path / "g++-12"  # a versioned compiler name
    compiler.write_text(f'#!/bin/sh\nwhile [ ! -e "{go}" ]; do sleep 0.05; done\n')
    compiler.chmod(0o755)
    orphan = subprocess.Popen([str(compiler)], cwd=build_dir)
    try:
        wait_for(lambda: _build_lock.leftover_builders(build_dir) == [orphan.pid], "the compiler is seen", [orphan])
        with pytest.raises(BuildError, match=f"kill {orphan.pid}"), build_lock(build_dir, wait_s=0.3):
            pass
    finally:
        go.touch()
        orphan.wait(timeout=BOUND_S)
    with build_lock(build_dir, wait_s=0):
        assert _build_lock.leftover_builders(build_dir) == []


def test_without_flock_a_torch_lock_fails_within_the_bound(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(_build_lock, "fcntl", None)  # as on Windows
    baton = tmp_path / BATON_FILE
    baton.touch()
    with pytest.raises(BuildError) as info, build_lock(tmp_path, wait_s=0.3):
        pass
    assert str(baton) in str(info.value) and f"delete {baton}" in str(info.value)
    baton.unlink()
    with build_lock(tmp_path, wait_s=0):
        assert not (tmp_path / LOCK_FILE).exists()


@pytest.mark.parametrize("raw", ["soon", "-1", "nan"])
def test_bad_wait_setting_is_named(monkeypatch, raw: str):
    monkeypatch.setenv(WAIT_ENV, raw)
    with pytest.raises(BuildError, match=WAIT_ENV):
        _build_lock.build_wait_s()


# --- the cache directory's key ------------------------------------------------------------------

def key_of(root: Path, cuda: bool = False) -> str:
    _loader._sources_digest.cache_clear()  # the digest is cached per process; these trees change
    return _loader.build_key(cuda, root)


def test_key_follows_source_content_not_place(tmp_path: Path):
    a, b = tmp_path / "a" / "csrc", tmp_path / "b" / "csrc"
    shutil.copytree(_loader.csrc_dir(), a)
    shutil.copytree(_loader.csrc_dir(), b)
    same = key_of(_loader.csrc_dir())
    assert key_of(a) == key_of(b) == same  # two checkouts of one commit share a build
    header = next(b.rglob("*.h"))
    os.utime(header, (0, 0))
    (b / "README.md").write_text("not a source")
    assert key_of(b) == same  # mtimes and docs do not matter
    header.write_text(header.read_text() + "\n// changed\n")
    assert key_of(b) != same  # content does
    header.write_text(header.read_text().removesuffix("\n// changed\n"))
    assert key_of(b) == same
    source = next((b / "cpu").glob("*.cpp"))
    source.rename(source.with_name("renamed.cpp"))
    assert key_of(b) != same  # so do relative paths
    (a / "cpu" / "extra.h").write_text("// new\n")
    assert key_of(a) != same  # and added files


def test_key_follows_build_configuration(tmp_path: Path, monkeypatch):
    same = key_of(_loader.csrc_dir())
    assert key_of(_loader.csrc_dir(), cuda=True) != same
    for name in ("CPU_FLAGS", "NVCC_FLAGS"):
        with monkeypatch.context() as m:
            m.setattr(_loader, name, [*getattr(_loader, name), "-DCHANGED"])
            assert _loader.build_key(False) != same, name
    with monkeypatch.context() as m:
        m.setenv("CXX", "/elsewhere/g++")
        assert _loader.build_key(False) != same
    real = shutil.which(os.environ.get("CXX", "c++"))
    if real is not None:  # the same compiler under another name is the same compiler
        (tmp_path / "cxx").symlink_to(real)
        monkeypatch.setenv("CXX", str(tmp_path / "cxx"))
        assert _loader.build_key(False) == same


def test_build_root_names_versions_and_key(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    root = _loader.build_root(False)
    assert root.parent == tmp_path / "lightning_optim"
    assert root.name.endswith(_loader.build_key(False))
    assert f"py{sys.version_info.major}{sys.version_info.minor}" in root.name
    assert _loader.build_root(True) != root


def test_sources_are_hashed_once_per_process():
    _loader.build_key(False)
    before = _loader._sources_digest.cache_info().misses
    _loader.build_root()
    _loader.build_key(True)
    assert _loader._sources_digest.cache_info().misses == before


@pytest.mark.slow
def test_cli_build_and_later_loads_share_the_directory(ext):
    """CI runs ``python -m lightning_optim.ops build`` before the tests: both must name one directory."""
    out = subprocess.run([sys.executable, "-m", "lightning_optim.ops", "build"], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    built = [line.split("kernels built in ", 1)[1] for line in out.stdout.splitlines() if "kernels built in" in line]
    assert [Path(p) for p in built] == [Path(ext.__file__)]
    assert "compiling" not in out.stderr  # it found the tests' build rather than making its own


# A second checkout of the same sources: a copy of csrc/ elsewhere, newer on disk; compiling is refused.
SECOND_CHECKOUT = """
import sys
from pathlib import Path
import torch.utils.cpp_extension
from lightning_optim.ops import _loader
_loader._CANDIDATES = (Path(sys.argv[1]),)
def no_compile(**kwargs):
    raise RuntimeError("load() called: this would compile")
torch.utils.cpp_extension.load = no_compile
module = _loader.build()
print("loaded", module.__file__, flush=True)
"""


@pytest.mark.slow
def test_a_second_checkout_loads_the_built_module_without_compiling(ext, tmp_path: Path):
    """Same sources in another place (newer timestamps, other paths, so ninja would rebuild): the module
    built for this key is imported as it is. Two checkouts used to rebuild each other back and forth."""
    copy = tmp_path / "checkout2" / "csrc"
    shutil.copytree(_loader.csrc_dir(), copy)
    assert _loader.build_key(_loader.want_cuda(), copy) == _loader.build_key(_loader.want_cuda())
    run = [sys.executable, "-c", SECOND_CHECKOUT, str(copy)]
    out = subprocess.run(run, capture_output=True, text=True, timeout=BOUND_S)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["loaded", ext.__file__]
    assert "compiling" not in out.stderr
    # negative control: where nothing was built for this key, the same process does try to compile
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "empty_cache")}
    out = subprocess.run(run, capture_output=True, text=True, timeout=BOUND_S, env=env)
    assert out.returncode != 0 and "load() called: this would compile" in out.stderr
