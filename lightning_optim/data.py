"""Byte-level text data for the demo job.

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
from pathlib import Path
from typing import Optional, Union

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler

SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}  # third-party code varies by machine


def stdlib_dir() -> Path:
    """The directory holding the running interpreter's standard-library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_files(root: Path, glob: str) -> list[Path]:
    """Files under ``root`` (recursively) whose name matches ``glob``, e.g. ``*.txt``.

    Hidden folders and third-party folders (site-packages, ...) are skipped: pruning them while
    walking keeps this fast even when the standard library has a large site-packages inside.
    """
    files = []
    for folder, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if not d.startswith(".") and d not in SKIPPED_DIRS]
        files.extend(Path(folder, n) for n in names if fnmatch.fnmatch(n, glob) and not n.startswith("."))
    files = [f for f in files if f.is_file()]
    # Order by a stable hash of the relative path: a cap on bytes then samples the whole tree
    # rather than the alphabetically first packages, and the order is the same on every machine.
    return sorted(files, key=lambda p: (zlib.crc32(p.relative_to(root).as_posix().encode()), p))


def read_capped(files: list[Path], max_bytes: Optional[int]) -> list[bytes]:
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
    path: Optional[Union[str, Path]], glob: str, max_bytes: Optional[int], val_fraction: float
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

    def __init__(self, data_source: Dataset, seed: int) -> None:
        super().__init__(data_source)
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        yield from torch.randperm(len(self.data_source), generator=generator).tolist()


class ByteDataModule(L.LightningDataModule):
    """Byte-level language-modelling data (vocabulary of 256).

    Args:
        path: a text file or a folder of text; ``None`` uses the standard library's ``.py`` files.
        glob: which files of a folder to use: a file-name pattern matched in every sub-folder.
        max_bytes: cap on bytes read in total (``None`` for no cap).
        val_fraction: share of files (or of the single file) held out for validation.
        seq_len: tokens per training sequence.
        batch_size: sequences per batch (per device).
        val_windows: how many (seeded, random) validation windows to score.
        seed: seeds the window offsets.
        num_workers: DataLoader workers (0 is fastest here: the data is one tensor in memory).
    """

    def __init__(
        self,
        path: Optional[str] = None,
        glob: str = "*.py",
        max_bytes: Optional[int] = 2_000_000,
        val_fraction: float = 0.1,
        seq_len: int = 128,
        batch_size: int = 16,
        val_windows: int = 256,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        for name, value in (("seq_len", seq_len), ("batch_size", batch_size), ("val_windows", val_windows)):
            if value < 1:
                raise ValueError(f"data.{name}={value} must be at least 1")
        self.path, self.glob, self.max_bytes = path, glob, max_bytes
        self.val_fraction, self.seq_len, self.batch_size = val_fraction, seq_len, batch_size
        self.val_windows, self.seed, self.num_workers = val_windows, seed, num_workers
        self.train_set: Optional[RandomWindows] = None
        self.val_set: Optional[RandomWindows] = None

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is not None:
            return
        train, val = load_corpus(self.path, self.glob, self.max_bytes, self.val_fraction)
        self._check_size("training", train)
        self._check_size("validation", val)
        train_t = torch.frombuffer(bytearray(train), dtype=torch.uint8)
        val_t = torch.frombuffer(bytearray(val), dtype=torch.uint8)
        # One epoch ~ one pass over the training bytes, but never less than one full batch.
        n_train = max(self.batch_size, len(train) // (self.seq_len + 1))
        self.train_set = RandomWindows(train_t, self.seq_len, n_train, seed=self.seed)
        self.val_set = RandomWindows(val_t, self.seq_len, self.val_windows, seed=self.seed + 1)

    def _check_size(self, split: str, text: bytes) -> None:
        if len(text) < self.seq_len + 1:
            source = "the standard library" if self.path is None else f"data.path='{self.path}'"
            raise ValueError(  # data.seq_len leads: the job reports the first data.* key named
                f"data.seq_len={self.seq_len} (+1) is more than the {len(text)} bytes of the {split} split of "
                f"{source}; use more text (data.max_bytes, data.path), a smaller data.seq_len, or another "
                f"data.val_fraction"
            )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False, drop_last=False)

    def _loader(self, dataset: Optional[Dataset], shuffle: bool, drop_last: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError("call setup() before asking for a dataloader")
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=EpochSeededSampler(dataset, self.seed) if shuffle else None,
            drop_last=drop_last,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )
