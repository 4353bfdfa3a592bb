"""Build and load the compiled extension (csrc/) with ``torch.utils.cpp_extension.load``.

Built once into a cache directory (``$TORCH_EXTENSIONS_DIR/lightning_optim`` if set, else
``~/.cache/lightning_optim``) named by torch, Python and a short hash of what the module depends on
(every source and header under csrc/ by content, the flags, the compiler, CUDA or not): two checkouts
of one commit share a build, two versions of the package keep one each. A directory whose build
finished (``<name>.built``) is imported as it is: ninja's timestamp and path checks would rebuild it
for every checkout of the same sources.

Builds in one directory take turns on an OS file lock (``build.lock``, see ``build_lock``): several
processes starting together (DDP ranks) build once, a killed build cannot leave the lock held, and the
lock file torch's ``load()`` itself leaves behind after a kill (which made every later load wait
forever) is cleared. The wait for another build is bounded (``LIGHTNING_OPTIM_BUILD_WAIT_S``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

from lightning_optim.ops._build_lock import BuildError, build_lock  # BuildError: also raised from here

# The source tree: csrc/ beside the package in a checkout, or shipped inside it in a wheel.
_PKG = Path(__file__).resolve().parent
_CANDIDATES = (_PKG / "csrc", _PKG.parent.parent / "csrc")

CPU_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-ffp-contract=off"]
NVCC_FLAGS = ["-O3", "--expt-relaxed-constexpr", "-DWITH_CUDA"]
BUILD_SECONDS = {"cpu": 60, "cuda": 240}  # rough, on 2 cores (a clean CPU build took 65 s under load); printed
# The kernel sources and headers (csrc/README.md and other files do not change the module).
KERNEL_SUFFIXES = frozenset({".c", ".cc", ".cpp", ".cu", ".cuh", ".h", ".hpp"})

_module: ModuleType | None = None
_error: str | None = None
_building = threading.RLock()  # a second thread waits for the first's result instead of loading twice


def csrc_dir() -> Path:
    for path in _CANDIDATES:
        if (path / "bindings.cpp").is_file():
            return path
    raise BuildError(f"the kernel sources (csrc/bindings.cpp) are not found in {[str(p) for p in _CANDIDATES]}")


def build_root(cuda: bool | None = None) -> Path:
    """The cache directory of this torch, Python, kernel source and build configuration
    (``cuda``: with the CUDA kernels; default: ``want_cuda()``)."""
    base = os.environ.get("TORCH_EXTENSIONS_DIR")
    root = Path(base) / "lightning_optim" if base else Path.home() / ".cache" / "lightning_optim"
    cuda = want_cuda() if cuda is None else cuda
    version = f"torch-{torch.__version__.split('+')[0]}-py{sys.version_info.major}{sys.version_info.minor}"
    return root / f"{version}-{build_key(cuda)}"


def build_key(cuda: bool, root: Path | None = None) -> str:
    """12 hex digits of a hash of everything the compiled module depends on: the kernel sources
    (``root``, default ``csrc_dir()``), CPU_FLAGS, NVCC_FLAGS, the compiler, CUDA or not, torch and Python."""
    compiler = os.environ.get("CXX", "c++")
    found = shutil.which(compiler)
    parts = {
        "sources": _sources_digest(root or csrc_dir()),
        "cpu_flags": CPU_FLAGS,
        "nvcc_flags": NVCC_FLAGS,
        "compiler": os.path.realpath(found) if found else compiler,  # resolves c++ -> g++-12
        "cuda": cuda,
        "torch": torch.__version__,  # with its local tag (+cpu, +cu124)
        "python": sys.implementation.cache_tag,
    }
    if cuda:  # nvcc and the architectures compiled for
        from torch.utils.cpp_extension import CUDA_HOME

        parts.update(cuda_home=CUDA_HOME, arch_list=os.environ.get("TORCH_CUDA_ARCH_LIST", ""))
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:12]


@functools.cache
def _sources_digest(root: Path) -> str:
    """sha256 of every kernel source and header under ``root``: relative path and content, not mtime or
    place, so two checkouts of one commit agree. Read once per process (``build(force=True)`` rereads)."""
    files = sorted((p.relative_to(root).as_posix(), p) for p in root.rglob("*")
                   if p.suffix in KERNEL_SUFFIXES and p.is_file())
    digest = hashlib.sha256()
    for relative, path in files:
        data = path.read_bytes()
        digest.update(f"{relative}\0{len(data)}\0".encode())  # lengths keep file boundaries unambiguous
        digest.update(data)
    return digest.hexdigest()


def want_cuda() -> bool:
    """Build the CUDA kernels too: torch has CUDA and nvcc is found."""
    if not torch.cuda.is_available():
        return False
    from torch.utils.cpp_extension import CUDA_HOME

    return CUDA_HOME is not None


def sources(cuda: bool) -> list[Path]:
    root = csrc_dir()
    files = [root / "bindings.cpp", *sorted(root.glob("bindings_*.cpp")), *sorted((root / "cpu").glob("*.cpp"))]
    if cuda:
        files += sorted((root / "cuda").glob("*.cu"))
    return files


def _missing_tools() -> str | None:
    from torch.utils.cpp_extension import is_ninja_available

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} not found on PATH; install g++ or set CXX)"
    if not is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    return None


def built_marker(build_dir: Path, name: str) -> Path:
    """Written once ``load()`` has built and imported the module in ``build_dir``. The directory is named by
    the hash of everything the module is built from, so a marked module is current however old it is:
    it is imported as it is, without asking ninja, whose timestamp and path checks would rebuild it for
    every checkout of the same sources (two checkouts would rebuild each other back and forth)."""
    return build_dir / f"{name}.built"


def _import_built(build_dir: Path, name: str) -> ModuleType | None:
    """The module built earlier in ``build_dir`` (marked by :func:`built_marker`), or None."""
    library = build_dir / f"{name}{'.pyd' if sys.platform == 'win32' else '.so'}"
    if not (built_marker(build_dir, name).is_file() and library.is_file()):
        return None
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _mark_built(build_dir: Path, name: str, key: str) -> None:
    marker = built_marker(build_dir, name)
    partial = marker.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(key + "\n")
    partial.replace(marker)  # atomic: a reader sees no marker or a whole one


def build(verbose: bool = False, force: bool = False) -> ModuleType:
    """Compile (if needed) and import the extension; raises BuildError with the reason."""
    global _module, _error
    if _module is not None and not force:
        return _module
    with _building:
        if _module is not None and not force:
            return _module
        if _error is not None and not force:
            raise BuildError(_error)
        if force:
            _sources_digest.cache_clear()
        try:
            _module = _build(verbose)
            _error = None
            return _module
        except BuildError as exc:
            _error = str(exc)
            raise
        except Exception as exc:  # compiler errors, linker errors, import errors
            _error = _short_reason(exc)
            raise BuildError(_error) from exc


def _build(verbose: bool) -> ModuleType:
    cuda = want_cuda()
    files = sources(cuda)
    name = "lightning_optim_kernels" + ("_cuda" if cuda else "")
    build_dir = build_root(cuda) / name
    module = _import_built(build_dir, name)  # the common case: built before, no lock, no ninja
    if module is None:
        with build_lock(build_dir):  # after waiting, another process may have built it
            module = _import_built(build_dir, name) or _compile(name, build_dir, files, cuda, verbose)
    if module.__file__ is None:  # an extension module loaded from a file always has one
        raise ImportError(f"{name}: the built module has no __file__ to check its C++ runtime")
    check_shared_cxx_runtime(Path(module.__file__))
    return module


def _compile(name: str, build_dir: Path, files: list[Path], cuda: bool, verbose: bool) -> ModuleType:
    missing = _missing_tools()  # only a build needs them: a module built earlier loads without
    if missing:
        raise BuildError(missing)
    from torch.utils.cpp_extension import load

    what = "CPU and CUDA" if cuda else "CPU"
    seconds = BUILD_SECONDS["cuda" if cuda else "cpu"]
    print(f"lightning-optim: compiling {what} kernels (one time, ~{seconds} s)...", file=sys.stderr, flush=True)
    started = time.perf_counter()
    module = load(
        name=name,
        sources=[str(f) for f in files],
        extra_cflags=CPU_FLAGS + (["-DWITH_CUDA"] if cuda else []),
        extra_cuda_cflags=NVCC_FLAGS,
        extra_ldflags=["-fopenmp"],
        extra_include_paths=[str(csrc_dir())],
        build_directory=str(build_dir),
        with_cuda=cuda,
        verbose=verbose,
    )
    _mark_built(build_dir, name, build_dir.parent.name)
    took = time.perf_counter() - started
    print(f"lightning-optim: kernels ready in {took:.0f} s ({build_dir})", file=sys.stderr, flush=True)
    return module


def needed_libraries(library: Path) -> list[str] | None:
    """The DT_NEEDED entries of a shared library (``readelf -d``); None where that cannot be read."""
    readelf = shutil.which("readelf")
    if readelf is None or not sys.platform.startswith("linux"):
        return None
    out = subprocess.run([readelf, "-d", str(library)], capture_output=True, text=True)
    if out.returncode != 0:
        return None
    return [line.split("[", 1)[1].split("]", 1)[0] for line in out.stdout.splitlines() if "(NEEDED)" in line]


def check_shared_cxx_runtime(library: Path) -> None:
    """Refuse a module that carries its own copy of the C++ runtime.

    A compiler configured to link libstdc++ statically (seen: a CUDA image whose ``CXX`` was such a
    GCC) puts a second libstdc++ in the process beside torch's: iostream locale ids then differ and
    the first error message the bindings format (any refused argument) crashes the process.
    """
    needed = needed_libraries(library)
    if needed is None or any(lib.startswith(("libstdc++", "libc++")) for lib in needed):
        return
    compiler = os.environ.get("CXX", "c++")
    raise BuildError(
        f"{library.name} links the C++ runtime statically (the compiler {compiler!r} does that), which crashes "
        f"beside torch's libstdc++; set CXX to a compiler that links libstdc++ dynamically (e.g. CXX=/usr/bin/g++), "
        f"delete {library.parent} and build again")


def _short_reason(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    lines = [line for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    picked = (errors or lines)[-3:]
    return f"{type(exc).__name__}: " + " | ".join(line.strip() for line in picked)[:600]


def last_error() -> str | None:
    return _error


def reset() -> None:
    """Forget a loaded module or a recorded failure (tests)."""
    global _module, _error
    _module = None
    _error = None
