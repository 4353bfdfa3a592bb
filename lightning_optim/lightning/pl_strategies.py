"""The 1-bit and comm-hook strategies for the standalone ``pytorch_lightning`` package.

Same behaviour and arguments as :mod:`lightning_optim.lightning.strategies`; the classes derive
from ``pytorch_lightning``'s ``DDPStrategy``/``Callback`` so a ``pytorch_lightning.Trainer``
accepts them. ``import lightning_optim`` registers them in ``pytorch_lightning``'s registry.
"""

from __future__ import annotations

from pytorch_lightning import Callback
from pytorch_lightning.strategies import DDPStrategy, ModelParallelStrategy

from lightning_optim.catalogue import STRATEGIES as _CATALOGUE
from lightning_optim.lightning import registry as _registry
from lightning_optim.lightning._comm_hook_strategies import _ConsensusTelemetryMixin
from lightning_optim.lightning._flavour import build
from lightning_optim.lightning._telemetry import _CommTelemetryMixin


class CommTelemetry(_CommTelemetryMixin, Callback):
    __doc__ = _CommTelemetryMixin.__doc__


class ConsensusTelemetry(_ConsensusTelemetryMixin, Callback):
    __doc__ = _ConsensusTelemetryMixin.__doc__


# One class per catalogue strategy: OnebitAdamStrategy, ..., PowerSGDStrategy, ... (lightning_optim.lightning._flavour).
_BASES: dict[str, type] = {"DDPStrategy": DDPStrategy, "ModelParallelStrategy": ModelParallelStrategy}
_CLASSES = build(_BASES, CommTelemetry, ConsensusTelemetry, __name__)
globals().update(_CLASSES)
STRATEGIES = {name: _CLASSES[entry.export] for name, entry in _CATALOGUE.items()}  # the catalogue's names
__all__ = [*_CLASSES, "CommTelemetry", "ConsensusTelemetry", "STRATEGIES"]  # noqa: PLE0604 - built from the catalogue

# Importing this module imported pytorch_lightning: make sure the names are registered there.
_registry.register("pytorch_lightning")
