"""What the compressed mlbench optimizers (``CentralizedSparsifiedSGD``, ``PowerSGD``) share: the
``world_size`` check, the params that take part, and the layout fields of their bounded cross-rank agreement.

Every param with ``requires_grad=True`` takes part in every step, in param-group order; a param without
a gradient on this rank counts as a zero gradient (its peers may have one, as under DDP), so every rank
runs the same collectives. Each optimizer checks its arguments on every rank at construction and its
layout at every step with one small bounded all-gather (``comm.agreement.agree``): a refusal or a
difference on one rank stops every rank with a clear error.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_optim.comm.agreement import fingerprint, layout_signature
from lightning_optim.comm.dense import world_size as group_world_size
from lightning_optim.optim.validation import check_distinct_params, check_int

__all__ = ["check_distinct_params", "check_float_params", "check_world_size", "trainable", "grads_or_zeros",
           "layout_fields"]


def check_world_size(world_size: object, group: Any) -> int:
    """``world_size`` must be an int equal to the ranks of ``group`` (1 without torch.distributed)."""
    check_int("world_size", world_size, 1)
    actual = group_world_size(group)
    if world_size != actual:
        initialized = dist.is_available() and dist.is_initialized()
        where = f"the process group has {actual} ranks" if initialized else "torch.distributed is not initialized"
        raise ValueError(
            f"world_size={world_size} must equal the number of ranks of the process group, {actual}: {where}")
    return int(world_size)


def check_float_params(params: Iterable[Tensor]) -> None:
    """Only real floating-point params can be optimized (an int or complex one would break every step)."""
    for i, p in enumerate(params):
        if not isinstance(p, Tensor):
            raise TypeError(f"params: param {i} must be a torch.Tensor, got {type(p).__name__}")
        if not p.is_floating_point():
            raise TypeError(f"params: only real floating-point parameters can be optimized, param {i} is {p.dtype}")


def trainable(param_groups: Sequence[Mapping[str, Any]]) -> list[Tensor]:
    return [p for group in param_groups for p in group["params"] if p.requires_grad]


def grads_or_zeros(params: Sequence[Tensor]) -> list[Tensor]:
    return [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]


def layout_fields(params: Sequence[Tensor]) -> dict[str, int]:
    return {"params": len(params), "elements": sum(p.numel() for p in params),
            "shapes": fingerprint(layout_signature(params))}

