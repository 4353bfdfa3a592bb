"""The byte data module: corpora from a folder, a single file and the standard library; errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_optim.data import ByteDataModule, list_files, load_corpus, stdlib_dir


def make(path, **kwargs) -> ByteDataModule:
    settings = dict(path=str(path), glob="*.txt", seq_len=16, batch_size=4, val_windows=8, seed=0)
    settings.update(kwargs)
    datamodule = ByteDataModule(**settings)
    datamodule.setup("fit")
    return datamodule


def test_folder_split_is_by_whole_file(text_folder: Path):
    files = list_files(text_folder, "*.txt")
    names = {f.name for f in files}
    assert names == {f"doc{i}.txt" for i in range(5)} | {"deep.txt"}  # nested found, hidden/.md skipped
    train, val = load_corpus(text_folder, "*.txt", max_bytes=None, val_fraction=0.2)
    contents = [f.read_bytes() for f in files]
    in_val = [c for c in contents if c in val]
    in_train = [c for c in contents if c in train]
    assert in_val and in_train
    assert not set(in_val) & set(in_train), "a file landed in both splits"
    assert len(train) + len(val) == sum(map(len, contents))


def test_folder_order_and_split_are_deterministic(text_folder: Path):
    first = load_corpus(text_folder, "*.txt", None, 0.3)
    assert load_corpus(text_folder, "*.txt", None, 0.3) == first


def test_single_file_split_is_contiguous(tmp_path: Path):
    path = tmp_path / "one.txt"
    text = bytes(range(256)) * 8
    path.write_bytes(text)
    train, val = load_corpus(path, "*.ignored", max_bytes=None, val_fraction=0.25)
    assert train + val == text
    assert len(val) == len(text) // 4


def test_max_bytes_caps_the_corpus(text_folder: Path):
    train, val = load_corpus(text_folder, "*.txt", max_bytes=1000, val_fraction=0.2)
    assert len(train) + len(val) == 1000


def test_windows_and_loaders(text_folder: Path):
    datamodule = make(text_folder)
    batch = next(iter(datamodule.train_dataloader()))
    assert batch.shape == (4, 17) and batch.dtype == torch.long
    assert int(batch.min()) >= 0 and int(batch.max()) < 256
    val_batches = list(datamodule.val_dataloader())
    assert sum(len(b) for b in val_batches) == 8
    # windows are real slices of the text: decoding gives back substrings of the corpus
    corpus = b"".join(f.read_bytes() for f in list_files(text_folder, "*.txt"))
    assert bytes(batch[0].tolist()) in corpus


def test_same_seed_same_windows_other_seed_other_windows(text_folder: Path):
    a, b, c = make(text_folder, seed=1), make(text_folder, seed=1), make(text_folder, seed=2)
    assert torch.equal(a.train_set.offsets, b.train_set.offsets)
    assert not torch.equal(a.train_set.offsets, c.train_set.offsets)


def test_single_file_module(tmp_path: Path):
    path = tmp_path / "notes.md"
    path.write_text("single file corpus. " * 100)
    batch = next(iter(make(path).train_dataloader()))
    assert batch.shape == (4, 17)


def test_stdlib_default_corpus():
    assert list_files(stdlib_dir(), "*.py"), "no standard-library sources found"
    train, val = load_corpus(None, "*.py", max_bytes=200_000, val_fraction=0.1)
    assert len(train) + len(val) == 200_000
    assert 0 < len(val) < len(train)
    assert b"def " in train and b"import" in train


def test_missing_path_names_the_setting(tmp_path: Path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=r"data\.path=.*nope.* does not exist"):
        make(missing)


def test_empty_folder_names_the_setting(tmp_path: Path):
    with pytest.raises(ValueError, match=r"data\.path=.*no files matching data\.glob='\*\.txt'"):
        make(tmp_path)


def test_only_empty_files(tmp_path: Path):
    (tmp_path / "a.txt").write_text("")
    with pytest.raises(ValueError, match=r"data\.path=.*only empty files"):
        make(tmp_path)


def test_corpus_too_small_names_the_setting(tmp_path: Path):
    path = tmp_path / "tiny.txt"
    path.write_text("x" * 100)
    with pytest.raises(ValueError, match=r"data\.seq_len=64"):
        make(path, seq_len=64)


@pytest.mark.parametrize(
    "setting,value,pattern",
    [("val_fraction", 1.0, r"data\.val_fraction=1\.0"), ("max_bytes", 0, r"data\.max_bytes=0")],
)
def test_bad_split_settings(text_folder: Path, setting, value, pattern):
    with pytest.raises(ValueError, match=pattern):
        make(text_folder, **{setting: value})


@pytest.mark.parametrize("setting", ["seq_len", "batch_size", "val_windows"])
def test_bad_sizes(text_folder: Path, setting):
    with pytest.raises(ValueError, match=rf"data\.{setting}=0"):
        ByteDataModule(path=str(text_folder), **{setting: 0})
