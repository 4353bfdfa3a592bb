"""Backend choice (LIGHTNING_OPTIM_BACKEND), the one fallback warning, the build command."""

from __future__ import annotations

import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import lightning_optim.optim as lo
from lightning_optim import ops
from lightning_optim.ops import _loader


@pytest.fixture
def broken_build(monkeypatch):
    """The extension 'fails to build' (as with a missing compiler) for this test only."""

    def fail(verbose):
        raise _loader.BuildError("no C++ compiler ('c++' not found on PATH; simulated)")

    saved = (_loader._module, _loader._error)
    monkeypatch.setattr(_loader, "_build", fail)
    monkeypatch.setattr(ops, "_warned", False)
    _loader.reset()
    yield
    _loader._module, _loader._error = saved


def step_adamw(backend_env, monkeypatch):
    if backend_env is None:
        monkeypatch.delenv(ops.ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(ops.ENV_VAR, backend_env)
    p = torch.ones(10, requires_grad=True)
    p.grad = torch.full((10,), 0.5)
    lo.AdamW([p], lr=0.1).step()
    return p.detach()


def test_invalid_backend_names_the_variable(monkeypatch):
    monkeypatch.setenv(ops.ENV_VAR, "gpu")
    with pytest.raises(ValueError, match="LIGHTNING_OPTIM_BACKEND='gpu'.*torch, cpu, cuda"):
        ops.backend_for("cpu")
    with pytest.raises(ValueError, match="LIGHTNING_OPTIM_BACKEND"):
        step_adamw("gpu", monkeypatch)


def test_backend_choice(monkeypatch, ext):
    monkeypatch.setenv(ops.ENV_VAR, "torch")
    assert ops.backend_for("cpu") == "torch"
    assert ops.raw_kernel("onebit_seg_unpack", "cpu") is None
    monkeypatch.setenv(ops.ENV_VAR, "cpu")
    assert ops.backend_for("cpu") == "cpu"
    assert ops.backend_for("meta") == "torch"
    assert ops.raw_kernel("onebit_seg_unpack", "cpu") is ext.onebit_seg_unpack
    monkeypatch.setenv(ops.ENV_VAR, "cuda")
    assert ops.backend_for("cpu") == "torch"  # cuda kernels only for CUDA tensors
    monkeypatch.setenv(ops.ENV_VAR, "AUTO")
    assert ops.backend_for("cpu") == "cpu"
    with pytest.raises(KeyError, match="unknown optimizer kernel"):
        ops.kernel("adamax", None)
    with pytest.raises(KeyError, match="unknown flat kernel"):
        ops.raw_kernel("adam", "cpu")  # an optimizer kernel is not a flat one


def test_fallback_warns_once_with_reason_and_matches(broken_build, monkeypatch):
    want = step_adamw("torch", monkeypatch)
    with pytest.warns(RuntimeWarning, match=r"compiled kernels unavailable.*no C\+\+ compiler.*pure-torch fallback"):
        got = step_adamw(None, monkeypatch)
    assert torch.equal(got, want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step_adamw(None, monkeypatch)  # no second warning
        step_adamw("torch", monkeypatch)  # an explicit torch backend never builds nor warns


def test_forced_backend_raises_when_unavailable(broken_build, monkeypatch):
    with pytest.raises(RuntimeError, match="LIGHTNING_OPTIM_BACKEND=cpu: the compiled kernels are unavailable.*compiler"):
        step_adamw("cpu", monkeypatch)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only build")
def test_forced_cuda_without_cuda_build(monkeypatch, ext):
    monkeypatch.setenv(ops.ENV_VAR, "cuda")
    with pytest.raises(RuntimeError, match="built without CUDA"):
        ops.backend_for("cuda")


def test_build_command(ext):
    out = subprocess.run([sys.executable, "-m", "lightning_optim.ops", "build"], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr
    assert "kernels built in" in out.stdout and "backends: cpu" in out.stdout


def _shared_library(tmp_path, name: str, flags: list[str]):
    source = tmp_path / "lib.cpp"
    source.write_text('#include <sstream>\n#include <string>\nstd::string fmt(long v) { std::ostringstream s; s << v; '
                      'return s.str(); }\n')
    out = tmp_path / name
    subprocess.run(["g++", "-shared", "-fPIC", *flags, str(source), "-o", str(out)], check=True)
    return out


@pytest.mark.skipif(shutil.which("g++") is None or shutil.which("readelf") is None, reason="needs g++ and readelf")
def test_static_cxx_runtime_is_refused(tmp_path):
    """A library with its own libstdc++ copy is refused with the remedy; a normal one and ours pass."""
    dynamic = _shared_library(tmp_path, "dynamic.so", [])
    static = _shared_library(tmp_path, "static.so", ["-static-libstdc++"])
    assert any(lib.startswith("libstdc++") for lib in _loader.needed_libraries(dynamic))
    _loader.check_shared_cxx_runtime(dynamic)
    with pytest.raises(_loader.BuildError, match="CXX=/usr/bin/g\\+\\+"):
        _loader.check_shared_cxx_runtime(static)


def test_built_extension_links_the_shared_runtime(ext):
    _loader.check_shared_cxx_runtime(Path(ext.__file__))
