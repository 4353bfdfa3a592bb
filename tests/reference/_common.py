"""Tiny helpers shared by the reference implementations (nothing optimizer-specific).

Every reference keeps its hyperparameters as plain attributes, its state in plain dicts of
tensors keyed by parameter index, and updates the given parameter tensors in place.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def as_param_list(params) -> list[torch.Tensor]:
    params = list(params)
    for p in params:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"params must be tensors, got {type(p).__name__}")
    return params


def check_grads(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> list:
    grads = list(grads)
    if len(grads) != len(params):
        raise ValueError(f"expected {len(params)} grads, got {len(grads)}")
    for p, g in zip(params, grads):
        if g is not None and g.shape != p.shape:
            raise ValueError(f"grad shape {tuple(g.shape)} does not match param shape {tuple(p.shape)}")
    return grads


def resolve_max_lr(lr: float, decouple_lr: bool, max_lr: float | None) -> float | None:
    """optimi convention: with `decouple_lr=True` and no `max_lr`, the initial lr is the max lr."""
    if decouple_lr and max_lr is None:
        return lr
    return max_lr


def decoupled_decay_factor(lr: float, weight_decay: float, decouple_lr: bool, max_lr: float | None) -> float:
    """Multiplicative factor of decoupled weight decay: p <- p * factor.

    torch-style decoupled:  factor = 1 - lr * wd
    fully decoupled (optimi ``decouple_lr=True``):  factor = 1 - (lr / max_lr) * wd
    """
    if decouple_lr:
        return 1.0 - (lr / max_lr) * weight_decay
    return 1.0 - lr * weight_decay
