"""Shared spawn for the comm tests: one run of 4 gloo ranks, results used by several modules."""
from __future__ import annotations

import pytest

from tests.comm.workers import run_all
from tests.distributed import run_workers


@pytest.fixture(scope="session")
def comm_spawn():
    """Per-rank result dicts of ``workers.run_all`` (spawned once per test session)."""
    return run_workers(4, run_all, timeout=180)
