"""Backends under test: torch always, cpu when a compiler is there (a failing build fails the
tests: CI prebuilds), cuda when a GPU is."""

from __future__ import annotations

import pytest
import torch

from lightning_optim import ops
from lightning_optim.ops import _loader

KERNEL_BACKENDS = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")),
]


def device_of(backend: str) -> str:
    return "cuda" if backend == "cuda" else "cpu"


@pytest.fixture
def ext():
    """The compiled module (skip only when the toolchain itself is missing)."""
    missing = _loader._missing_tools()
    if missing:
        pytest.skip(f"no toolchain for the extension: {missing}")
    return ops.build()


@pytest.fixture
def use_backend(monkeypatch, ext):
    """Set LIGHTNING_OPTIM_BACKEND for the test."""

    def set_backend(name: str) -> None:
        monkeypatch.setenv(ops.ENV_VAR, name)

    return set_backend
