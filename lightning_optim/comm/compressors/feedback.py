r"""Error feedback (error compensation), the reusable piece every compressor here shares.

For one tensor with residual :math:`e` (zeros at the start) and compressor :math:`C`:

.. math::
    c = g + e, \qquad s = C(c), \qquad e \leftarrow c - s

so after :math:`T` steps :math:`\sum_t s_t + e_T = \sum_t g_t` (up to the rounding of the additions):
nothing the compressor drops is lost, only delayed (Seide et al. 2014; Karimireddy et al. 2019;
Stich et al. 2018). For PowerSGD :math:`s` is the *aggregated* low-rank approximation, known only after
its collectives (Vogels et al. 2019), which is why :func:`absorb_` takes ``sent`` explicitly.

``compensate`` and ``absorb_`` are the two formulas; :class:`ErrorFeedback` holds residuals by key (a
param index, a DDP bucket index) for owners that do not keep them in their own state, with a
``state_dict`` for checkpoints (residuals differ per rank: each rank saves its own).
"""
from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["ErrorFeedback", "absorb_", "compensate"]


def compensate(tensor: Tensor, residual: Tensor) -> Tensor:
    """``c = g + e`` as a new tensor (``tensor`` and ``residual`` stay as they are), in the wider dtype."""
    return residual + tensor


def absorb_(residual: Tensor, corrected: Tensor, sent: Tensor) -> Tensor:
    """``e <- c - s`` in place: what the compressor did not deliver this step."""
    return residual.copy_(corrected - sent)


class ErrorFeedback:
    """Residuals by key, made as zeros on first use (``dtype``: theirs, or the tensor's when None).

    A residual whose shape, dtype or device no longer fits its key's tensor (DDP rebuilds its buckets
    after the first iteration) is replaced by zeros and counted in ``resets``.
    """

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"dtype must be None or a floating torch.dtype, got {dtype!r}")
        self.dtype = dtype
        self._residuals: dict[Hashable, Tensor] = {}
        self.resets = 0

    def residual(self, key: Hashable, like: Tensor) -> Tensor:
        """The residual of ``key``, shaped like ``like`` (contiguous)."""
        dtype = self.dtype or like.dtype
        e = self._residuals.get(key)
        if e is None or e.shape != like.shape or e.dtype != dtype or e.device != like.device:
            if e is not None:
                self.resets += 1
            e = self._residuals[key] = torch.zeros(like.shape, dtype=dtype, device=like.device)
        return e

    def residuals(self, keys: Sequence[Hashable], tensors: Sequence[Tensor]) -> list[Tensor]:
        if len(keys) != len(tensors):
            raise ValueError(f"keys: {len(keys)} keys for {len(tensors)} tensors")
        return [self.residual(k, t) for k, t in zip(keys, tensors)]

    def __len__(self) -> int:
        return len(self._residuals)

    def __contains__(self, key: object) -> bool:
        return key in self._residuals

    def clear(self) -> None:
        self._residuals.clear()

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": {k: e.clone() for k, e in self._residuals.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        residuals = state.get("residuals") if isinstance(state, Mapping) else None
        if not isinstance(residuals, Mapping) or not all(isinstance(e, Tensor) and e.is_floating_point()
                                                         for e in residuals.values()):
            raise ValueError("state: an ErrorFeedback state_dict holds {'residuals': {key: floating tensor}}")
        self._residuals = {k: e.clone() for k, e in residuals.items()}
