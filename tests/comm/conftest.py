"""Shared run for the comm tests: one run of 4 gloo ranks (threads), results used by several modules."""
from __future__ import annotations

import pytest

from tests.comm.workers import run_all
from tests.ranks import run_ranks


@pytest.fixture(scope="session")
def comm_spawn():
    """Per-rank result dicts of ``workers.run_all`` (run once per test session)."""
    return run_ranks(4, run_all, timeout=180)
