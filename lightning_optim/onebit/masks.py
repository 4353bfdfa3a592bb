"""Masks on the 1-bit optimizers' communicated momenta: the user's ``exp_avg_mask`` per group, and
the automatic mask of elements whose gradient stayed (all but) zero while the variance was estimated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lightning_optim.onebit.layout import Layout

if TYPE_CHECKING:  # the optimizer this is mixed into (see onebit/host.py)
    from lightning_optim.onebit.host import OnebitHost as _Host
else:
    _Host = object

__all__ = ["MomentumMaskMixin"]


# Multiply only the masked elements while they are fewer than 1 in this many.
SPARSE_MASK_RATIO = 16


class MomentumMaskMixin(_Host):
    """Mask methods of :class:`~lightning_optim.onebit.base.OnebitOptimizer`."""

    def _mask_(self, layout: Layout, views: list[Tensor]) -> None:
        """Multiply by each group's ``exp_avg_mask`` (DeepSpeed: after the compressed allreduce)."""
        for i, gi in enumerate(layout.group_of):
            group = self.param_groups[gi]
            mask = group.get("exp_avg_mask")
            if mask is not None:
                if mask.device != layout.device:
                    mask = group["exp_avg_mask"] = mask.to(layout.device)
                views[i].mul_(mask)

    def _zero_mask(self, layout: Layout) -> Tensor | None:
        r"""The automatic mask: 0 for the elements whose frozen variance says their gradient was
        (all but) zero through the full-precision steps, 1 elsewhere; None when ``auto_mask`` is False
        or no element qualifies. Element ``i`` of param ``j`` is masked when
        :math:`v_i \le \rho^2 \bar v_j` (:math:`\bar v_j` the mean of :math:`v` over param ``j``,
        :math:`\rho` = ``auto_mask``; :math:`\rho = 0`: exact zeros only). Such an element's compressed
        momentum is +-scale noise, and dividing it by its tiny :math:`\sqrt{v_i}` would move it by up
        to :math:`1/\rho` times a normal step, every step. Cached until the variance changes."""
        if self.auto_mask is None:
            return None
        version = (id(self._flats.get("exp_avg_sq")), self._variance_version())
        cached = layout.scratch.get("zero_mask")
        if cached is None or cached[0] != version:
            variance = self._flat("exp_avg_sq")
            numels = torch.tensor(layout.numels, device=variance.device)
            ids = torch.repeat_interleave(torch.arange(len(layout.numels), device=variance.device), numels)
            means = torch.zeros(len(layout.numels), dtype=torch.float64, device=variance.device)
            means.index_add_(0, ids, variance.double()).div_(numels.clamp(min=1))
            keep = variance.double() > (self.auto_mask**2) * means[ids]
            mask = None if bool(keep.all()) else keep.to(torch.float32)
            masked = None if mask is None else torch.nonzero(~keep).flatten()
            cached = layout.scratch["zero_mask"] = (version, mask, masked)
        return cached[1]

    def _auto_mask_(self, layout: Layout, flat: Tensor) -> None:
        """``flat *= zero mask`` (see :meth:`_zero_mask`), after every compressed allreduce. Where few
        elements are masked (the usual case) only those are multiplied (by 0: the same values, signed
        zeros and NaNs included, as the full multiply), not a pass over the whole buffer."""
        mask = self._zero_mask(layout)
        if mask is None:
            return
        masked = layout.scratch["zero_mask"][2]
        if masked.numel() * SPARSE_MASK_RATIO < flat.numel():
            flat.index_copy_(0, masked, flat.index_select(0, masked).mul_(0.0))
        else:
            flat.mul_(mask)
