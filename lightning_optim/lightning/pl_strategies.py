"""The 1-bit and comm-hook strategies for the standalone ``pytorch_lightning`` package.

Same behaviour and arguments as :mod:`lightning_optim.lightning.strategies`; the classes derive
from ``pytorch_lightning``'s ``DDPStrategy``/``Callback`` so a ``pytorch_lightning.Trainer``
accepts them. ``import lightning_optim`` registers them in ``pytorch_lightning``'s registry.
"""

from __future__ import annotations

from pytorch_lightning import Callback
from pytorch_lightning.strategies import DDPStrategy

from lightning_optim.catalogue import STRATEGIES as _CATALOGUE
from lightning_optim.lightning import registry as _registry
from lightning_optim.lightning._base import _OnebitAdamMixin, _OnebitLambMixin, _ZeroOneAdamMixin
from lightning_optim.lightning._comm_hook_strategies import (
    _ConsensusTelemetryMixin,
    _DecentralizedMixin,
    _PowerSGDMixin,
    _RandomKMixin,
    _SignSGDMixin,
    _FP16CompressMixin,
    _TopKMixin,
)
from lightning_optim.lightning._telemetry import _CommTelemetryMixin

__all__ = ["OnebitAdamStrategy", "ZeroOneAdamStrategy", "OnebitLambStrategy", "PowerSGDStrategy", "TopKStrategy",
           "RandomKStrategy", "SignSGDStrategy", "DecentralizedStrategy", "FP16CompressStrategy", "CommTelemetry",
           "ConsensusTelemetry", "STRATEGIES"]


class CommTelemetry(_CommTelemetryMixin, Callback):
    __doc__ = _CommTelemetryMixin.__doc__


class OnebitAdamStrategy(_OnebitAdamMixin, DDPStrategy):
    __doc__ = _OnebitAdamMixin.__doc__
    telemetry_callback_class = CommTelemetry


class ZeroOneAdamStrategy(_ZeroOneAdamMixin, DDPStrategy):
    __doc__ = _ZeroOneAdamMixin.__doc__
    telemetry_callback_class = CommTelemetry


class OnebitLambStrategy(_OnebitLambMixin, DDPStrategy):
    __doc__ = _OnebitLambMixin.__doc__
    telemetry_callback_class = CommTelemetry


class ConsensusTelemetry(_ConsensusTelemetryMixin, Callback):
    __doc__ = _ConsensusTelemetryMixin.__doc__


# The comm-hook strategies (DDP + one of lightning_optim.comm.ddp_hooks on every device).
class PowerSGDStrategy(_PowerSGDMixin, DDPStrategy):
    __doc__ = _PowerSGDMixin.__doc__
    telemetry_callback_class = CommTelemetry


class TopKStrategy(_TopKMixin, DDPStrategy):
    __doc__ = _TopKMixin.__doc__
    telemetry_callback_class = CommTelemetry


class RandomKStrategy(_RandomKMixin, DDPStrategy):
    __doc__ = _RandomKMixin.__doc__
    telemetry_callback_class = CommTelemetry


class SignSGDStrategy(_SignSGDMixin, DDPStrategy):
    __doc__ = _SignSGDMixin.__doc__
    telemetry_callback_class = CommTelemetry


class FP16CompressStrategy(_FP16CompressMixin, DDPStrategy):
    __doc__ = _FP16CompressMixin.__doc__
    telemetry_callback_class = CommTelemetry


class DecentralizedStrategy(_DecentralizedMixin, DDPStrategy):
    __doc__ = _DecentralizedMixin.__doc__
    telemetry_callback_class = CommTelemetry
    consensus_callback_class = ConsensusTelemetry


STRATEGIES = {name: globals()[entry.export] for name, entry in _CATALOGUE.items()}  # the catalogue's names

# Importing this module imported pytorch_lightning: make sure the names are registered there.
_registry.register("pytorch_lightning")
