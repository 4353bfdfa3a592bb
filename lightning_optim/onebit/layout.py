"""Where the trained params of a 1-bit optimizer live in its flat buffers, and its step-count check.

Params sharded by FSDP2 (``fully_shard``) are DTensors: the optimizer keeps its states, reads its
gradients and writes its updates on each DTensor's local shard (:func:`local_tensor`), so the math
never runs DTensor ops (which may run collectives, and whose ``numel()`` is the global one).
"""

from __future__ import annotations

import numbers
from typing import Any

import torch
from torch import Tensor

from lightning_optim.comm.agreement import layout_signature

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without distributed: no DTensor can reach us
    DTensor = None  # type: ignore[assignment,misc]  # the name stays, as None


def local_tensor(t: Tensor) -> Tensor:
    """This rank's shard of a DTensor (a view: in-place writes reach the DTensor), else ``t`` itself."""
    return t.to_local() if DTensor is not None and isinstance(t, DTensor) else t


class Layout:
    """The trained params of all groups, in group order, and their places in a flat buffer.

    ``params`` are the optimizer's params (the state keys); ``tensors`` what the math reads and writes:
    the params themselves, or their local shards for DTensors (sizes, offsets and views follow them).
    """

    def __init__(self, param_groups: list[dict[str, Any]]) -> None:
        self.params: list[Tensor] = []
        self.group_of: list[int] = []
        for gi, group in enumerate(param_groups):
            for p in group["params"]:
                if p.requires_grad:
                    self.params.append(p)
                    self.group_of.append(gi)
        self.key = tuple(id(p) for p in self.params)
        self.tensors: list[Tensor] = [local_tensor(p) for p in self.params]
        self.offsets, offset = [], 0
        self.numels = [t.numel() for t in self.tensors]
        for numel in self.numels:
            self.offsets.append(offset)
            offset += numel
        self.numel = offset
        devices = {t.device for t in self.tensors}
        if len(devices) > 1:
            raise ValueError(
                f"params: 1-bit optimizers need every param on one device, got {sorted(map(str, devices))}")
        self.device = devices.pop() if devices else torch.device("cpu")
        self.buckets: list[tuple[int, list[int]]] = []  # filled once the states exist
        # work buffers by name ((flat, views): OnebitOptimizer._scratch) and the zero mask's cache (masks.py)
        self.scratch: dict[str, Any] = {}
        self._signature: tuple[int, ...] | None = None

    def views(self, flat: Tensor) -> list[Tensor]:
        return [flat[o : o + t.numel()].view(t.shape) for o, t in zip(self.offsets, self.tensors)]

    def refresh(self) -> bool:
        """Re-read the local shards (FSDP may give a shard new storage, e.g. on ``model.to()``); False when
        a shard's shape changed, so the flat buffers no longer fit and the layout must be rebuilt."""
        tensors = [local_tensor(p) for p in self.params]
        if any(t.shape != old.shape for t, old in zip(tensors, self.tensors)):
            return False
        self.tensors = tensors
        return True

    def signature(self) -> tuple[int, ...]:
        """(param count, elements, checksum of the shapes, checksum of the dtypes): what every rank
        must agree on; computed once per layout (the per-step agreement sends it)."""
        if self._signature is None:
            self._signature = layout_signature(self.tensors)
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
