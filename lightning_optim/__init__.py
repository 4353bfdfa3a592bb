"""lightning-optim: fast, communication-efficient optimizers for PyTorch Lightning, Accelerate,
the Hugging Face Trainer and Hydra.

Importing this package must stay cheap: it must not import Lightning, Hydra or the training job.
The main job lives in ``lightning_optim.train`` (``python -m lightning_optim.train``).
"""

from typing import TYPE_CHECKING

__version__ = "0.1.0"

# The catalogue's Lightning strategies ("onebit_adam", ...): registered in lightning.pytorch and
# pytorch_lightning as soon as those are imported (before or after this package), without importing them here.
from lightning_optim.lightning.registry import install as _install_strategies

_install_strategies()

from lightning_optim.catalogue import DISTRIBUTED as _DISTRIBUTED
from lightning_optim.catalogue import OPTIMIZERS as _OPTIMIZERS
from lightning_optim.catalogue import STRATEGIES as _STRATEGIES
from lightning_optim.optim import (
    FlatParameters,
    flatten_parameters,
    prepare_for_gradient_release,
    remove_gradient_release,
)
from lightning_optim.precision import DynamicLossScaler, FP16Optimizer, MasterWeights

# prepare_for_gradient_release(ddp_model, ...) dispatches to the DDP comm hook registered there
import lightning_optim.comm.ddp_hooks.release  # noqa: E402,F401,I001

# Every optimizer of the catalogue at the top level, under its class name (the catalogue is the one list).
globals().update({_entry.export: _entry.cls for _entry in _OPTIMIZERS.values()})

if TYPE_CHECKING:  # the same names for type checkers and IDEs; tests/test_catalogue.py keeps both equal
    from lightning_optim.onebit import OnebitAdam, OnebitLamb, ZeroOneAdam
    from lightning_optim.optim import (
        SGD,
        Adam,
        AdamW,
        Adan,
        CPUAdam,
        FusedAdam,
        FusedLamb,
        FusedSGD,
        Lamb,
        Lars,
        Lion,
        RAdam,
        Ranger,
        SignSGD,
        SparsifiedSGD,
        StableAdamW,
    )
    from lightning_optim.distributed import (
        CentralizedAdam,
        CentralizedSGD,
        CentralizedSparsifiedSGD,
        CustomCentralizedOptimizer,
        DecentralizedSGD,
        DiLoCo,
        GenericCentralizedOptimizer,
        PowerSGD,
    )
    from lightning_optim.lightning import (
        DecentralizedStrategy,
        DiLoCoStrategy,
        FP16CompressStrategy,
        OnebitAdamStrategy,
        OnebitFSDPStrategy,
        OnebitLambStrategy,
        PowerSGDStrategy,
        RandomKStrategy,
        SignSGDStrategy,
        StreamingDiLoCoStrategy,
        TopKStrategy,
        ZeroOneAdamStrategy,
    )

# The Lightning strategy classes (without importing Lightning until first use) and mlbench's distributed
# optimizers, at the top level, loaded on first access.
_LAZY = {_entry.export: "lightning_optim.lightning" for _entry in _STRATEGIES.values()}
_LAZY.update({_entry.export: "lightning_optim.distributed" for _entry in _DISTRIBUTED.values()})


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(
    [e.export for e in _OPTIMIZERS.values()] + list(_LAZY)
    + ["DynamicLossScaler", "FP16Optimizer", "FlatParameters", "MasterWeights", "flatten_parameters",
       "prepare_for_gradient_release", "remove_gradient_release"]
)
