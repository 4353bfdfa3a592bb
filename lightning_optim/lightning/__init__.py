"""Lightning adapters (no math here; see ``lightning_optim.onebit``, ``.precision``, ``.optim``).

* :class:`OnebitAdamStrategy`, :class:`ZeroOneAdamStrategy`, :class:`OnebitLambStrategy`
  (``strategies.py``), registered as ``"onebit_adam"``, ``"zero_one_adam"``, ``"onebit_lamb"``
  in ``lightning.pytorch`` and ``pytorch_lightning`` by ``import lightning_optim``
  (``registry.py``); the ``pytorch_lightning`` classes live in ``pl_strategies.py``.
* :class:`PowerSGDStrategy`, :class:`TopKStrategy`, :class:`RandomKStrategy`, :class:`SignSGDStrategy`,
  :class:`DecentralizedStrategy`, :class:`FP16CompressStrategy` (``strategies.py``, mixins in
  ``_comm_hook_strategies.py``): DDP with one of :mod:`lightning_optim.comm.ddp_hooks` on every device,
  registered as ``"powersgd"``, ``"topk"``, ``"randomk"``, ``"sign_sgd"``, ``"decentralized"``, ``"fp16_compress"``.
* :class:`DiLoCoStrategy`, :class:`StreamingDiLoCoStrategy` (``_diloco.py``), ``"diloco"``,
  ``"streaming_diloco"``: the optimizer wrapped in :class:`lightning_optim.DiLoCo`, no gradient all-reduce.
* :class:`FTDiLoCoStrategy`, :class:`FTDDPStrategy` (``_ft.py``), ``"ft_diloco"``, ``"ft_ddp"``: one process per
  replica group on torchft (``lightning_optim.fault_tolerance``): DiLoCo or per-step data parallelism across the
  replicas alive, a dead replica costing one exchange.
* :class:`OnebitFSDPStrategy` (``_fsdp.py``), ``"onebit_fsdp"``: Lightning's FSDP2 strategy on a
  (replicate, shard) mesh with 1-bit Adam across the replicas (:func:`lightning_optim.onebit.onebit_fsdp`).
* :class:`CommTelemetry` (``callbacks.py``): ``comm/*`` metrics per step; :class:`ConsensusTelemetry`:
  the decentralized strategy's ``comm/consensus_distance``.
* :func:`to_onebit` (``convert.py``): the optimizer conversion the strategies use.
* :class:`MasterWeightsPrecision`, :class:`KahanPrecision` (``precision.py``): precision plugins.
* :class:`GradientRelease` (``release.py``): gradient release on one device and under DDP.

Needs Lightning (``pip install 'lightning-optim[lightning]'``): importing this package without it raises an
``ImportError`` naming the extra. The names above load their modules on first access.
"""

from __future__ import annotations

import importlib
from typing import Any

from lightning_optim.extras import require

require("lightning", "lightning_optim.lightning (the Lightning strategies, plugins and callbacks)")

__all__ = ["OnebitAdamStrategy", "ZeroOneAdamStrategy", "OnebitLambStrategy", "PowerSGDStrategy", "TopKStrategy",
           "RandomKStrategy", "SignSGDStrategy", "DecentralizedStrategy", "FP16CompressStrategy", "OnebitFSDPStrategy",
           "DiLoCoStrategy", "StreamingDiLoCoStrategy", "FTDiLoCoStrategy", "FTDDPStrategy", "CommTelemetry",
           "ConsensusTelemetry", "to_onebit", "MasterWeightsPrecision", "KahanPrecision", "GradientRelease"]

_WHERE = {
    "OnebitAdamStrategy": "strategies",
    "ZeroOneAdamStrategy": "strategies",
    "OnebitLambStrategy": "strategies",
    "PowerSGDStrategy": "strategies",
    "TopKStrategy": "strategies",
    "RandomKStrategy": "strategies",
    "SignSGDStrategy": "strategies",
    "FP16CompressStrategy": "strategies",
    "DecentralizedStrategy": "strategies",
    "OnebitFSDPStrategy": "strategies",
    "DiLoCoStrategy": "strategies",
    "StreamingDiLoCoStrategy": "strategies",
    "FTDiLoCoStrategy": "strategies",
    "FTDDPStrategy": "strategies",
    "ConsensusTelemetry": "strategies",
    "CommTelemetry": "callbacks",
    "to_onebit": "convert",
    "MasterWeightsPrecision": "precision",
    "KahanPrecision": "precision",
    "GradientRelease": "release",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
