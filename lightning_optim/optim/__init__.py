"""Single-process optimizers; the shared machinery lives in :mod:`.base`."""

from lightning_optim.optim.adam import Adam, AdamW
from lightning_optim.optim.base import BaseOptimizer
from lightning_optim.optim.release import prepare_for_gradient_release, remove_gradient_release
from lightning_optim.optim.aliases import CPUAdam, FusedAdam, FusedSGD
from lightning_optim.optim.sgd import SGD

__all__ = [
    "Adam",
    "AdamW",
    "BaseOptimizer",
    "CPUAdam",
    "FusedAdam",
    "FusedSGD",
    "SGD",
    "prepare_for_gradient_release",
    "remove_gradient_release",
]
