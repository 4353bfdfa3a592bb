"""What the two HF Trainer scripts (hf_script.py, hf_diloco_script.py) share: the ``--trainer`` choice between
the library's classes and the stock ``transformers`` ones after ``register()``, and the training data."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import transformers
from transformers import HfArgumentParser

import accel_plugins.hf
from lightning_optim.data import RandomWindows, load_corpus


@dataclass
class ScriptArguments:
    trainer: str = field(default="library", metadata={"choices": ["library", "stock"]})


def use_route() -> tuple[type, type]:
    """The phase's ``--trainer`` read first (the stock parser must be built after register()); its classes."""
    if HfArgumentParser(ScriptArguments).parse_known_args()[0].trainer == "stock":
        accel_plugins.hf.register()
        return transformers.TrainingArguments, transformers.Trainer
    accel_plugins.hf.unregister()  # a library phase after a stock one: transformers as a fresh process has it
    return accel_plugins.hf.TrainingArguments, accel_plugins.hf.Trainer


def training_data(max_bytes: int) -> list[dict]:
    """32-byte windows of the Python standard library's sources, as GPT-2 inputs and labels."""
    train, _ = load_corpus(None, "*.py", max_bytes=max_bytes, val_fraction=0.1)
    windows = RandomWindows(torch.frombuffer(bytearray(train), dtype=torch.uint8), 32, 512, seed=0)
    return [{"input_ids": w[:32].long(), "labels": w[:32].long()} for w in (windows[i] for i in range(len(windows)))]
