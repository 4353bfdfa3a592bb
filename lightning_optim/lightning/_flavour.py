"""The strategy classes of one Lightning package (``lightning.pytorch`` or ``pytorch_lightning``), built
from the catalogue: each class is its name's mixin (the behaviour, written once) on that package's
``DDPStrategy`` (``ModelParallelStrategy`` for ``onebit_fsdp``), with that package's telemetry callbacks.
``strategies.py`` / ``pl_strategies.py`` call :func:`build` with their package's classes.
"""

from __future__ import annotations

from lightning_optim.catalogue import STRATEGIES
from lightning_optim.lightning._base import _OnebitAdamMixin, _OnebitLambMixin, _ZeroOneAdamMixin
from lightning_optim.lightning._comm_hook_strategies import (
    _DecentralizedMixin,
    _FP16CompressMixin,
    _PowerSGDMixin,
    _RandomKMixin,
    _SignSGDMixin,
    _TopKMixin,
)
from lightning_optim.lightning._diloco import _DiLoCoMixin, _StreamingDiLoCoMixin
from lightning_optim.lightning._fsdp import _OnebitFSDPMixin
from lightning_optim.lightning._ft import _FTDDPMixin, _FTDiLoCoMixin

__all__ = ["MIXINS", "build"]

# the catalogue's class name -> the mixin that holds its behaviour
MIXINS: dict[str, type] = {
    "OnebitAdamStrategy": _OnebitAdamMixin, "ZeroOneAdamStrategy": _ZeroOneAdamMixin,
    "OnebitLambStrategy": _OnebitLambMixin, "PowerSGDStrategy": _PowerSGDMixin, "TopKStrategy": _TopKMixin,
    "RandomKStrategy": _RandomKMixin, "SignSGDStrategy": _SignSGDMixin, "FP16CompressStrategy": _FP16CompressMixin,
    "DecentralizedStrategy": _DecentralizedMixin, "OnebitFSDPStrategy": _OnebitFSDPMixin,
    "DiLoCoStrategy": _DiLoCoMixin, "StreamingDiLoCoStrategy": _StreamingDiLoCoMixin,
    "FTDiLoCoStrategy": _FTDiLoCoMixin, "FTDDPStrategy": _FTDDPMixin,
}


def build(bases: dict[str, type], comm_telemetry: type, consensus_telemetry: type, module: str) -> dict[str, type]:
    """``{class name: class}`` for every catalogue strategy, as if written in ``module`` (so they pickle);
    ``bases``: that package's strategy classes by name (``DDPStrategy``, ``ModelParallelStrategy``)."""
    classes = {}
    for entry in STRATEGIES.values():
        mixin = MIXINS[entry.export]
        body = {"__doc__": mixin.__doc__, "__module__": module, "__qualname__": entry.export,
                "telemetry_callback_class": comm_telemetry}
        if issubclass(mixin, _DecentralizedMixin):
            body["consensus_callback_class"] = consensus_telemetry
        classes[entry.export] = type(entry.export, (mixin, bases[entry.base]), body)
    return classes
