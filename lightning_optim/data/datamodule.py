"""`ByteDataModule`: the corpus of ``corpus.py`` as a LightningDataModule (the one module of the data
package that imports Lightning; ``lightning_optim.data`` loads it on first use of the name)."""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_optim.data.corpus import EpochSeededSampler, RandomWindows, load_corpus

__all__ = ["ByteDataModule"]


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
        path: str | None = None,
        glob: str = "*.py",
        max_bytes: int | None = 2_000_000,
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
        self.train_set: RandomWindows | None = None
        self.val_set: RandomWindows | None = None

    def setup(self, stage: str | None = None) -> None:
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

    def _loader(self, dataset: RandomWindows | None, shuffle: bool, drop_last: bool) -> DataLoader:
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
