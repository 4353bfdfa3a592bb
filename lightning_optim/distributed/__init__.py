"""mlbench-core's distributed optimizers as plain-PyTorch optimizers, on any torch.distributed backend.

* centralized (synchronous, all-reduce): ``GenericCentralizedOptimizer``, ``CentralizedSGD``,
  ``CentralizedAdam``, ``CustomCentralizedOptimizer`` (``centralized.py``);
* compressed: ``CentralizedSparsifiedSGD`` (``sparsified.py``), ``PowerSGD`` (``powersgd.py``), on the
  compressors and error feedback of :mod:`lightning_optim.comm.compressors`;
* decentralized (gossip over a topology, point-to-point): ``DecentralizedSGD`` (``decentralized.py``);
* low-communication: ``DiLoCo`` (``diloco.py``): any inner optimizer, an outer Nesterov step on the averaged
  pseudo-gradient every ``sync_every`` steps; Streaming DiLoCo's fragments and overlap; compressed exchanges.

Importing this package imports none of them; each name loads its module on first access.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers see; at run time each name loads its module on first access
    from lightning_optim.distributed.centralized import (
        CentralizedAdam,
        CentralizedSGD,
        CustomCentralizedOptimizer,
        GenericCentralizedOptimizer,
    )
    from lightning_optim.distributed.decentralized import DecentralizedSGD
    from lightning_optim.distributed.diloco import DiLoCo
    from lightning_optim.distributed.powersgd import PowerSGD
    from lightning_optim.distributed.sparsified import CentralizedSparsifiedSGD

_WHERE = {
    "GenericCentralizedOptimizer": "centralized",
    "CentralizedSGD": "centralized",
    "CentralizedAdam": "centralized",
    "CustomCentralizedOptimizer": "centralized",
    "CentralizedSparsifiedSGD": "sparsified",
    "PowerSGD": "powersgd",
    "DecentralizedSGD": "decentralized",
    "DiLoCo": "diloco",
}

__all__ = ["CentralizedAdam", "CentralizedSGD", "CentralizedSparsifiedSGD", "CustomCentralizedOptimizer",
           "DecentralizedSGD", "DiLoCo", "GenericCentralizedOptimizer", "PowerSGD"]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
