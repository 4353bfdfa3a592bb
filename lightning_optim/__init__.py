"""lightning-optim: fast, communication-efficient optimizers for PyTorch Lightning, Accelerate,
the Hugging Face Trainer and Hydra.

Importing this package must stay cheap: it must not import Lightning, Hydra or the training job.
The main job lives in ``lightning_optim.train`` (``python -m lightning_optim.train``).
"""

__version__ = "0.1.0"

# Public API re-exports (optimizers, strategies) go below this line as they land.

# Lightning strategies "onebit_adam", "zero_one_adam", "onebit_lamb": registered in lightning.pytorch
# and pytorch_lightning as soon as those are imported (before or after this package), without
# importing them here. The classes: lightning_optim.lightning.OnebitAdamStrategy, ...
from lightning_optim.lightning.registry import install as _install_strategies

_install_strategies()

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
    prepare_for_gradient_release,
    remove_gradient_release,
)
from lightning_optim.precision import DynamicLossScaler, FP16Optimizer, MasterWeights

# The Lightning strategy classes, at the top level without importing Lightning until first use.
_LAZY = {"OnebitAdamStrategy": "lightning_optim.lightning", "ZeroOneAdamStrategy": "lightning_optim.lightning",
         "OnebitLambStrategy": "lightning_optim.lightning"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "OnebitAdamStrategy",
    "OnebitLambStrategy",
    "ZeroOneAdamStrategy",
    "SGD",
    "Adam",
    "AdamW",
    "Adan",
    "CPUAdam",
    "DynamicLossScaler",
    "FP16Optimizer",
    "FusedAdam",
    "FusedLamb",
    "FusedSGD",
    "Lamb",
    "Lars",
    "Lion",
    "MasterWeights",
    "OnebitAdam",
    "OnebitLamb",
    "RAdam",
    "Ranger",
    "SignSGD",
    "SparsifiedSGD",
    "StableAdamW",
    "ZeroOneAdam",
    "prepare_for_gradient_release",
    "remove_gradient_release",
]
