"""Byte-level text data for the demo job.

``corpus`` is framework-free (torch only): `load_corpus`, `RandomWindows`, `EpochSeededSampler`, for
Accelerate and HF Trainer scripts too. `ByteDataModule` wraps them for Lightning; it is imported on first
use of the name (it needs the ``[lightning]`` extra); the rest needs torch alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_optim.data.corpus import (
    SKIPPED_DIRS,
    EpochSeededSampler,
    RandomWindows,
    list_files,
    load_corpus,
    read_capped,
    split_corpus,
    stdlib_dir,
)
from lightning_optim.lazy_names import lazy_names

if TYPE_CHECKING:  # what type checkers see; at run time the name loads its module (and Lightning) on first use
    from lightning_optim.data.datamodule import ByteDataModule

_LIGHTNING_NAMES = {"ByteDataModule": "lightning_optim.data.datamodule"}

__all__ = ["SKIPPED_DIRS", "EpochSeededSampler", "RandomWindows", "list_files", "load_corpus", "read_capped",
           "split_corpus", "stdlib_dir", "ByteDataModule"]


__getattr__, __dir__ = lazy_names(__name__, _LIGHTNING_NAMES)
