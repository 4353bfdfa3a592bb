"""The Lightning strategy classes the strategy mixins are mixed into, as type checkers see them, and
:func:`attached` for the attributes Lightning sets during setup.

``_flavour.build`` puts each mixin on ``DDPStrategy`` or ``ModelParallelStrategy`` of ``lightning.pytorch`` or
``pytorch_lightning``, whichever package is in use, so at run time the mixins derive from ``object``; while type
checking they derive from ``lightning.pytorch``'s classes, whose attributes and methods they use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar, cast

__all__ = ["DDPBase", "ModelParallelBase", "ParallelBase", "attached", "ddp_model"]

T = TypeVar("T")

if TYPE_CHECKING:
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, ParallelStrategy
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    DDPBase = DDPStrategy
    ModelParallelBase = ModelParallelStrategy
    ParallelBase = ParallelStrategy
else:
    DDPBase = ModelParallelBase = ParallelBase = object


def attached(value: T | None, what: str) -> T:
    """``value`` (a strategy attribute Lightning sets during setup: ``lightning_module``, ``model``, ...), or a
    ``RuntimeError`` naming ``what`` when a hook runs before Lightning set it."""
    if value is None:
        raise RuntimeError(f"{what} is not set yet: the strategy runs a hook before Lightning's setup set it")
    return value


def ddp_model(model: nn.Module | None) -> DistributedDataParallel:
    """A DDP strategy's ``model`` after setup: the DDP-wrapped module (where comm hooks are registered)."""
    return cast("DistributedDataParallel", attached(model, "model"))
