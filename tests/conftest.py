"""Shared fixtures: composing the job's Hydra config, and small text corpora on disk."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from lightning_optim.conf_dir import conf_dir


@pytest.fixture
def compose_train() -> Callable[..., DictConfig]:
    """Compose ``train.yaml`` with the given overrides, as the command line would."""

    def _compose(*overrides: str) -> DictConfig:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            return compose(config_name="train", overrides=list(overrides))

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
