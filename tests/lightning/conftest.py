"""One spawn of 2 gloo ranks for the Lightning tests (``workers.suite``), shared by modules."""

from __future__ import annotations

import pytest

from tests.distributed import run_workers
from tests.lightning.workers import suite


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    """Per-rank result dicts of ``workers.suite``."""
    return run_workers(2, suite, str(tmp_path_factory.mktemp("lightning")), timeout=300)

