"""Tiny helpers shared by the reference implementations: argument checks, the per-parameter loop and
state, and the decay/momentum conventions that several of them follow (torch, optimi).

Every reference keeps its hyperparameters as plain attributes, its state in plain dicts of
tensors keyed by parameter index, and updates the given parameter tensors in place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

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


def with_grads(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> Iterator[tuple]:
    """``(index, param, grad)`` for the params that have a grad this step (None = skipped)."""
    for i, (p, g) in enumerate(zip(params, grads)):
        if g is not None:
            yield i, p, g


def lazy_state(state: dict[int, dict], i: int, init: Callable[[], dict]) -> dict:
    """The state of param ``i``, made by ``init()`` at its first step with a grad."""
    st = state.get(i)
    if st is None:
        st = state[i] = init()
    return st


def resolve_max_lr(lr: float, decouple_lr: bool, max_lr: float | None) -> float | None:
    """optimi convention: with `decouple_lr=True` and no `max_lr`, the initial lr is the max lr."""
    if decouple_lr and max_lr is None:
        return lr
    return max_lr


def decay_coefficient(lr: float, weight_decay: float, decouple_lr: bool, max_lr: float | None) -> float:
    """The decoupled decay coefficient (kappa).

    torch-style decoupled:  kappa = lr * wd
    fully decoupled (optimi ``decouple_lr=True``):  kappa = (lr / max_lr) * wd
    """
    if decouple_lr:
        return (lr / max_lr) * weight_decay
    return lr * weight_decay


def decoupled_decay_factor(lr: float, weight_decay: float, decouple_lr: bool, max_lr: float | None) -> float:
    """Multiplicative factor of decoupled weight decay: p <- p * (1 - kappa)."""
    return 1.0 - decay_coefficient(lr, weight_decay, decouple_lr, max_lr)


def decay_or_l2(p: torch.Tensor, g: torch.Tensor, lr: float, weight_decay: float, *, decoupled: bool,
                decouple_lr: bool, max_lr: float | None) -> torch.Tensor:
    """torch's two weight-decay forms (optimi's ``decouple_lr`` implies the decoupled one):
    decoupled shrinks ``p`` in place and returns ``g``; L2 returns ``g + wd * p``."""
    if weight_decay == 0:
        return g
    if decoupled or decouple_lr:
        p.mul_(decoupled_decay_factor(lr, weight_decay, decouple_lr, max_lr))
        return g
    return g + weight_decay * p


def torch_momentum(state: dict[int, dict], i: int, d: torch.Tensor, momentum: float,
                   dampening: float = 0.0) -> torch.Tensor:
    """torch.optim.SGD's momentum buffer of param ``i``: a copy of ``d`` at its first step (no
    dampening), then ``momentum * buf + (1 - dampening) * d``. Returns the buffer."""
    st = state.get(i)
    if st is None:
        st = state[i] = {"momentum_buffer": d.clone()}
    else:
        buf = st["momentum_buffer"]
        buf.copy_(momentum * buf + (1 - dampening) * d)
    return st["momentum_buffer"]
