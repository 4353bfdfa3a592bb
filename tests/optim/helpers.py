"""Deterministic parameter sets and gradient streams shared by the optimizer tests."""

from __future__ import annotations

from collections.abc import Callable

import torch

SHAPES = [(7, 5), (13,), (3, 4, 2), (1,)]


def make_params(dtype: torch.dtype = torch.float32, seed: int = 0, shapes=SHAPES) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype).requires_grad_() for s in shapes]


def clone_params(params: list[torch.Tensor], dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    return [p.detach().clone().to(dtype or p.dtype).requires_grad_() for p in params]


def grad_stream(shapes=SHAPES, steps: int = 10, seed: int = 1) -> list[list[torch.Tensor]]:
    """``steps`` lists of float64 gradients, one per shape."""
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes] for _ in range(steps)]


def two_groups(params: list[torch.Tensor], **second) -> list[dict]:
    """Split ``params`` into two groups; the second overrides ``second``."""
    return [{"params": params[:2]}, {"params": params[2:], **second}]


def run_steps(opt: torch.optim.Optimizer, params: list[torch.Tensor], grads: list[list[torch.Tensor]],
              before_step: Callable[[int], None] | None = None) -> None:
    """Feed each gradient list (cast to each param's dtype) and step."""
    for i, step_grads in enumerate(grads):
        for p, g in zip(params, step_grads):
            p.grad = g.to(p.dtype)
        if before_step is not None:
            before_step(i)
        opt.step()


def max_abs_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x.detach().double() - y.detach().double()).abs().max().item() for x, y in zip(a, b))
