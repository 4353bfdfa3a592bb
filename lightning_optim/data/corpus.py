"""Byte-level text data for the demo job, framework-free (the Lightning data module: ``datamodule.py``).

By default the corpus is the Python standard library's own ``.py`` sources (present wherever
Python is), so the job needs no download. ``data.path`` points it at your own text instead.

Splits are deterministic: by file when there are several files (a file is wholly train or wholly
validation), by contiguous region when there is only one.
"""

from __future__ import annotations

import fnmatch
import os
import sysconfig
import zlib
from collections.abc import Sized
from pathlib import Path

import torch
from torch.utils.data import Dataset, RandomSampler

SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}  # third-party code varies by machine


def stdlib_dir() -> Path:
    """The directory holding the running interpreter's standard-library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_files(root: Path, glob: str) -> list[Path]:
    """Files under ``root`` (recursively) whose name matches ``glob``, e.g. ``*.txt``.

    Hidden folders and third-party folders (site-packages, ...) are skipped: pruning them while
    walking keeps this fast even when the standard library has a large site-packages inside.
    """
    files: list[Path] = []
    for folder, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if not d.startswith(".") and d not in SKIPPED_DIRS]
        files.extend(Path(folder, n) for n in names if fnmatch.fnmatch(n, glob) and not n.startswith("."))
    files = [f for f in files if f.is_file()]
    # Order by a stable hash of the relative path: a cap on bytes then samples the whole tree
    # rather than the alphabetically first packages, and the order is the same on every machine.
    return sorted(files, key=lambda p: (zlib.crc32(p.relative_to(root).as_posix().encode()), p))


def read_capped(files: list[Path], max_bytes: int | None) -> list[bytes]:
    """Read files in order until ``max_bytes`` in total (the last one truncated); ``None`` = no cap."""
    texts, total = [], 0
    for path in files:
        if max_bytes is not None and total >= max_bytes:
            break
        text = path.read_bytes()
        if max_bytes is not None:
            text = text[: max_bytes - total]
        if text:
            texts.append(text)
            total += len(text)
    return texts


def split_corpus(texts: list[bytes], val_fraction: float) -> tuple[bytes, bytes]:
    """Return (train, validation) bytes: whole documents when there are several, else one cut."""
    if len(texts) >= 2:
        n_val = min(len(texts) - 1, max(1, round(len(texts) * val_fraction)))
        return b"".join(texts[n_val:]), b"".join(texts[:n_val])
    text = b"".join(texts)
    cut = len(text) - max(1, int(len(text) * val_fraction))
    return text[:cut], text[cut:]


def load_corpus(
    path: str | Path | None, glob: str, max_bytes: int | None, val_fraction: float
) -> tuple[bytes, bytes]:
    """Load and split the corpus; errors name the ``data.*`` setting at fault."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"data.val_fraction={val_fraction} must be strictly between 0 and 1")
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"data.max_bytes={max_bytes} must be positive (or null for no cap)")
    if path is None:
        files = list_files(stdlib_dir(), glob)
        where = f"the standard library ({stdlib_dir()})"
    else:
        root = Path(path).expanduser()
        if not root.exists():
            raise FileNotFoundError(f"data.path='{path}' does not exist")
        files = [root] if root.is_file() else list_files(root, glob)
        where = f"data.path='{path}'"
    if not files:
        raise ValueError(f"{where} has no files matching data.glob='{glob}'")
    texts = read_capped(files, max_bytes)
    if not texts:
        raise ValueError(f"{where} holds only empty files")
    return split_corpus(texts, val_fraction)


class RandomWindows(Dataset):
    """Fixed, seeded random windows of ``seq_len + 1`` bytes (inputs plus the shifted targets).

    The offsets are drawn once, so item ``i`` is the same on every rank: a distributed sampler
    then hands each rank different windows.
    """

    def __init__(self, data: torch.Tensor, seq_len: int, num_windows: int, seed: int) -> None:
        self.data = data
        self.window = seq_len + 1
        generator = torch.Generator().manual_seed(seed)
        self.offsets = torch.randint(0, len(data) - self.window + 1, (num_windows,), generator=generator)

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, index: int) -> torch.Tensor:
        start = int(self.offsets[index])
        return self.data[start : start + self.window].long()


class EpochSeededSampler(RandomSampler):
    """A random order drawn from ``(seed, epoch)`` only, so a run resumed from a checkpoint sees the
    same batches as the uninterrupted run (a plain RandomSampler draws from the global RNG, whose
    state a checkpoint does not hold). Lightning calls ``set_epoch``; under DDP it replaces this
    sampler (a RandomSampler) by a shuffling DistributedSampler, which is epoch-seeded too."""

    def __init__(self, data_source: Sized, seed: int) -> None:
        super().__init__(data_source)
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        yield from torch.randperm(len(self.data_source), generator=generator).tolist()
