"""Where the trained params of a 1-bit optimizer live in its flat buffers, and its step-count check."""

from __future__ import annotations

import numbers
from typing import Any

import torch
from torch import Tensor

from lightning_optim.comm.agreement import layout_signature


class Layout:
    """The trained params of all groups, in group order, and their places in a flat buffer."""

    def __init__(self, param_groups: list[dict[str, Any]]) -> None:
        self.params: list[Tensor] = []
        self.group_of: list[int] = []
        for gi, group in enumerate(param_groups):
            for p in group["params"]:
                if p.requires_grad:
                    self.params.append(p)
                    self.group_of.append(gi)
        self.key = tuple(id(p) for p in self.params)
        self.offsets, offset = [], 0
        self.numels = [p.numel() for p in self.params]
        for numel in self.numels:
            self.offsets.append(offset)
            offset += numel
        self.numel = offset
        devices = {p.device for p in self.params}
        if len(devices) > 1:
            raise ValueError(f"params: 1-bit optimizers need every param on one device, got {sorted(map(str, devices))}")
        self.device = devices.pop() if devices else torch.device("cpu")
        self.buckets: list[tuple[int, list[int]]] = []  # filled once the states exist
        self.scratch: dict[str, tuple[Tensor, list[Tensor]]] = {}
        self._signature: tuple[int, ...] | None = None

    def views(self, flat: Tensor) -> list[Tensor]:
        return [flat[o : o + p.numel()].view(p.shape) for o, p in zip(self.offsets, self.params)]

    def signature(self) -> tuple[int, ...]:
        """(param count, elements, checksum of the shapes, checksum of the dtypes): what every rank
        must agree on; computed once per layout (the per-step agreement sends it)."""
        if self._signature is None:
            self._signature = layout_signature(self.params)
        return self._signature


VARIANCE_FIRST = ("the compression stage divides by the variance estimated in the full-precision steps, so "
                  "at least one must come first")


def check_step_count(name: str, value: object, minimum: int = 0, why: str = "") -> int:
    """An integer step count >= ``minimum`` (numpy integers accepted); ``why`` explains the minimum."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} ({value!r})")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value}" + (f": {why}" if why else ""))
    return value
