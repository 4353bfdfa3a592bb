"""The suite's schedule (tests/conftest.py ``LONG_FILES_FIRST``) names test files that exist: a renamed file
would silently drop to its collection place and run last on a worker."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import LONG_FILES_FIRST

ROOT = Path(__file__).resolve().parent.parent


def test_every_long_file_named_first_exists_once():
    assert len(set(LONG_FILES_FIRST)) == len(LONG_FILES_FIRST)
    missing = [name for name in LONG_FILES_FIRST if not (ROOT / name).is_file()]
    assert not missing, missing
