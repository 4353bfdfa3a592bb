"""Plumbing shared by the W-worker references of the 1-bit optimizers (no optimizer math here).

Every reference holds one copy of the params and states per simulated worker (lists indexed
``[worker][param]``, fp32), and one :class:`RefOnebitAllreduce` that plays the compressed
allreduce over the flat concatenation of all params' tensors, in param order, one segment (one
scale) per param.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .hierarchical_allreduce import RefHierarchicalAllreduce
from .onebit_allreduce import RefOnebitAllreduce


class Workers:
    def __init__(self, params, world_size: int, lrs=None, masks=None):
        params = [p.detach().float() for p in params]
        self.world = world_size
        self.shapes = [p.shape for p in params]
        self.numel = sum(p.numel() for p in params)
        self.params = [[p.clone() for p in params] for _ in range(world_size)]
        self.lrs = list(lrs) if lrs is not None else None
        self.masks = list(masks) if masks is not None else [None] * len(params)
        self.per_node: int | None = None  # hierarchical(per_node): fp32 in a node, 1-bit across nodes
        self.new_allreduce()

    def new_allreduce(self) -> None:
        """A fresh compressed allreduce: all error buffers back to zero."""
        segments = [torch.Size(s).numel() for s in self.shapes]
        if self.per_node is None:
            self.allreduce = RefOnebitAllreduce(self.numel, self.world, segments=segments)
        else:
            self.allreduce = RefHierarchicalAllreduce(self.numel, self.world // self.per_node, self.per_node,
                                                      segments=segments)

    def hierarchical(self, per_node: int) -> None:
        """From now on the compressed mean is the hierarchical one (fresh error buffers)."""
        self.per_node = per_node
        self.new_allreduce()

    def zeros(self) -> list[list[Tensor]]:
        return [[torch.zeros(s) for s in self.shapes] for _ in range(self.world)]

    @staticmethod
    def mean(per_worker: list[Tensor]) -> Tensor:
        total = per_worker[0].clone()
        for x in per_worker[1:]:
            total = total + x
        return total / len(per_worker)

    def compressed_mean(self, per_worker: list[list[Tensor]], masked: bool = True) -> list[Tensor]:
        """The 1-bit average of every worker's tensors (one flat buffer), split per param and
        multiplied by the masks; the same list is what every worker receives."""
        flat = self.allreduce.step([torch.cat([x.reshape(-1) for x in xs]) for xs in per_worker])
        out, offset = [], 0
        for j, shape in enumerate(self.shapes):
            n = torch.Size(shape).numel()
            piece = flat[offset : offset + n].reshape(shape).clone()
            if masked and self.masks[j] is not None:
                piece = piece * self.masks[j]
            out.append(piece)
            offset += n
        return out
