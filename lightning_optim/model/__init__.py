"""A small decoder-only (GPT-style) byte language model for the demo job.

``gpt`` is torch only: `ByteGPT`, `param_groups`, `warmup_cosine`, usable from Accelerate and HF Trainer
scripts. `LanguageModel`, the LightningModule that trains it, is imported on first use of the name (it needs
the ``[lightning]`` extra); ``ByteGPT`` needs torch alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_optim.lazy_names import lazy_names
from lightning_optim.model.gpt import VOCAB_SIZE, Block, ByteGPT, CausalSelfAttention, param_groups, warmup_cosine

if TYPE_CHECKING:  # what type checkers see; at run time the name loads its module (and Lightning) on first use
    from lightning_optim.model.language_model import LanguageModel

_LIGHTNING_NAMES = {"LanguageModel": "lightning_optim.model.language_model"}

__all__ = ["VOCAB_SIZE", "Block", "ByteGPT", "CausalSelfAttention", "param_groups", "warmup_cosine",
           "LanguageModel"]


__getattr__, __dir__ = lazy_names(__name__, _LIGHTNING_NAMES)
