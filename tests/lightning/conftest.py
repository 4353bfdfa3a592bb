"""One spawn of 2 gloo ranks for the Lightning tests (``workers.suite``), shared by modules; no test leaves
a process group or distributed environment variables behind."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from tests.distributed import run_workers
from tests.lightning.workers import suite


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    """Per-rank result dicts of ``workers.suite``."""
    return run_workers(2, suite, str(tmp_path_factory.mktemp("lightning")), timeout=300)




@pytest.fixture(autouse=True)
def _nothing_distributed_left_behind():
    """An in-process fit with a DDP strategy (world 1) makes Lightning start a process group and export
    WORLD_SIZE, LOCAL_RANK, MASTER_ADDR...; nothing ends either, and a later test in this process
    (Accelerate's ``prepare``) would then take itself for a distributed run."""
    environ = dict(os.environ)
    had_group = dist.is_available() and dist.is_initialized()
    yield
    if not had_group and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)
