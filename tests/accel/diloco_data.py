"""The model and per-rank data of ``accelerate_diloco_script.py``, shared with its test's reference run."""

from __future__ import annotations

import torch
from torch import nn

STEPS, SAVE_AT, SYNC_EVERY, MICRO = 12, 6, 4, 2  # SAVE_AT lies between the synchronisations after steps 4 and 8
MAX_NORM, LR, WEIGHT_DECAY = 10.0, 1e-2, 0.01


def build_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 4))


def batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``micro`` of optimizer step ``step`` (0-based) on ``rank``: each rank its own data."""
    g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
    return torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)
