"""What the 1-bit optimizers' mixins (``checkpoint``, ``masks``, ``units``, ``auto_freeze``) use of the optimizer
they are mixed into, for type checkers: :class:`~lightning_optim.onebit.base.OnebitOptimizer` provides it all.

The mixins derive from :class:`OnebitHost` only while type checking (at run time from ``object``): ``onebit.base``
imports them, so they cannot name ``OnebitOptimizer`` itself.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from lightning_optim.comm.compressors.onebit import OnebitCompressor
from lightning_optim.onebit.layout import Layout
from lightning_optim.optim.base import BaseOptimizer

__all__ = ["OnebitHost"]


class OnebitHost(BaseOptimizer):
    """The attributes and methods of ``OnebitOptimizer`` that its mixins read (never instantiated: the bodies
    below stand for ``OnebitOptimizer``'s own, which come first in every real class's MRO)."""

    process_group: Any
    compressor: OnebitCompressor
    hierarchical: bool | int
    auto_mask: float | None
    freeze_vote_group: Any
    _sched: dict[str, Any]
    _layout: Layout | None
    _flats: dict[str, Tensor]
    _flat_views: dict[str, list[Tensor]]
    _plain_state_extras: tuple[str, ...]

    def _world(self) -> tuple[int, int]:
        raise NotImplementedError

    def _flat(self, key: str) -> Tensor:
        raise NotImplementedError

    def _variance_version(self) -> int:
        raise NotImplementedError

    def _initial_schedule(self) -> dict[str, Any]:
        raise NotImplementedError

    def _schedule_keys_added_since(self, schedule: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def _check_schedule(self, schedule: object) -> None:
        raise NotImplementedError

    def _warn_errors_reset(self, why: str) -> None:
        raise NotImplementedError

    def _schedule_after_plain_steps(self, step: int) -> dict[str, Any]:
        raise NotImplementedError
