"""Shared fixtures: composing the job's Hydra config, and small text corpora on disk."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import pytest

if TYPE_CHECKING:
    from omegaconf import DictConfig


def pytest_configure(config):
    """One intra-op thread for the tests run in this process (unless ``OMP_NUM_THREADS`` says otherwise), as
    every ``run_workers`` rank has. The tests' tensors are small: a second thread gains little on an idle
    machine, and on a busy one each parallel op waits for a descheduled thread - measured on 2 cores with two
    other busy processes, tests/ops/test_optim_kernels.py, test_custom_ops.py, test_master_weights.py and
    test_tensor_lr.py took 383 s with torch's default 2 threads and 119 s with 1 (at rest: 47 s and 46 s)."""
    global _THREADS
    import os

    if config.getoption("numprocesses", None) and not hasattr(config, "workerinput"):
        return  # pytest-xdist's controller runs no test: no torch import before it starts the workers
    import torch

    if not os.environ.get("OMP_NUM_THREADS"):
        _THREADS = 1
        torch.set_num_threads(_THREADS)


_THREADS: int | None = None  # the intra-op threads of this process (None: OMP_NUM_THREADS decides)


@pytest.fixture(autouse=True)
def _intra_op_threads():
    """Back to one thread after a test that changed it (Lightning sets cores // processes threads when it
    starts a fit in this process)."""
    yield
    if _THREADS is not None:
        import torch

        if torch.get_num_threads() != _THREADS:
            torch.set_num_threads(_THREADS)


# Measured seconds per test file (tests/durations.py refreshes it from a JUnit report): the README's command runs two
# pytest workers that take whole files in collection order (`--dist loadfile --no-loadscope-reorder`), so the
# longest files go first and the many short ones fill the gaps beside them, instead of one long file running alone
# at the end. Only a schedule: a stale figure costs wall time, never a result.
DURATIONS = Path(__file__).with_name("durations.json")


def pytest_collection_modifyitems(session, config, items):
    """Longest measured files first; an unmeasured file after them, in collection order; each file's tests in
    their order."""
    root = Path(__file__).resolve().parent.parent
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}

    def key(item) -> float:
        try:
            return -seconds.get(Path(item.path).resolve().relative_to(root).as_posix(), 0.0)
        except ValueError:  # a test outside this checkout
            return 0.0

    items.sort(key=key)  # stable


_COMPOSED: dict[tuple[str, ...], "DictConfig"] = {}  # overrides -> the composed config (never handed out itself)


@pytest.fixture
def compose_train() -> Callable[..., "DictConfig"]:
    """Compose ``train.yaml`` with the given overrides, as the command line would.

    Each distinct list of overrides is composed once per session (Hydra's compose takes ~0.1 s, and the
    config probes compose the same options hundreds of times); every call gets its own deep copy, so a test
    that edits its config changes nothing another test sees. Interpolations stay unresolved in the copy
    (``${oc.env:...}`` reads the environment when the test resolves it, as before)."""

    def _compose(*overrides: str) -> DictConfig:
        from hydra import compose, initialize_config_dir

        from lightning_optim.conf_dir import conf_dir

        key = tuple(overrides)
        if key not in _COMPOSED:
            with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
                _COMPOSED[key] = compose(config_name="train", overrides=list(overrides))
        return copy.deepcopy(_COMPOSED[key])

    return _compose


@pytest.fixture
def text_folder(tmp_path: Path) -> Path:
    """A folder of six distinct text files (one nested, one hidden folder that must be skipped)."""
    root = tmp_path / "corpus"
    (root / "nested").mkdir(parents=True)
    (root / ".hidden").mkdir()
    for i in range(5):
        (root / f"doc{i}.txt").write_text(f"document {i}: " + "the quick brown fox jumps. " * (40 + i))
    (root / "nested" / "deep.txt").write_text("nested text " * 50)
    (root / ".hidden" / "secret.txt").write_text("SECRET " * 100)
    (root / "notes.md").write_text("not matched by *.txt")
    return root
