"""Single-process optimizers; the shared machinery lives in :mod:`.base`."""

from lightning_optim.optim.adam import Adam, AdamW
from lightning_optim.optim.adan import Adan
from lightning_optim.optim.aliases import CPUAdam, FusedAdam, FusedSGD
from lightning_optim.optim.base import BaseOptimizer
from lightning_optim.optim.flat_params import FlatParameters, flatten_parameters
from lightning_optim.optim.lamb import FusedLamb, Lamb
from lightning_optim.optim.lars import Lars
from lightning_optim.optim.lion import Lion
from lightning_optim.optim.radam import RAdam
from lightning_optim.optim.ranger import Ranger
from lightning_optim.optim.release import prepare_for_gradient_release, remove_gradient_release
from lightning_optim.optim.sgd import SGD
from lightning_optim.optim.sign_sgd import SignSGD
from lightning_optim.optim.sparsified_sgd import SparsifiedSGD
from lightning_optim.optim.stableadamw import StableAdamW

__all__ = [
    "Adam",
    "AdamW",
    "Adan",
    "BaseOptimizer",
    "CPUAdam",
    "FlatParameters",
    "FusedAdam",
    "FusedLamb",
    "FusedSGD",
    "Lamb",
    "Lars",
    "Lion",
    "RAdam",
    "Ranger",
    "SGD",
    "SignSGD",
    "SparsifiedSGD",
    "StableAdamW",
    "flatten_parameters",
    "prepare_for_gradient_release",
    "remove_gradient_release",
]
