"""lightning-optim: fast, communication-efficient optimizers for PyTorch Lightning, Accelerate,
the Hugging Face Trainer and Hydra.

Importing this package needs torch alone and changes no other library's modules. It imports Lightning only
where Lightning is installed, to register the strategy names (``Trainer(strategy="onebit_adam")``); never
Hydra, matplotlib, transformers, Accelerate or the training job. The main job lives in
``lightning_optim.train`` (``python -m lightning_optim.train``).
"""

__version__ = "0.1.0"

# The optimizers of the catalogue (lightning_optim.catalogue) under their class names; tests/test_catalogue.py
# keeps these imports and __all__ equal to the catalogue. The release module: prepare_for_gradient_release(ddp_model,
# ...) dispatches to the DDP comm hook it registers.
import lightning_optim.comm.ddp_hooks.release  # noqa: F401
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
from lightning_optim.lazy_names import lazy_names as _lazy_names
from lightning_optim.onebit import OnebitAdam, OnebitLamb, ZeroOneAdam
from lightning_optim.optim import (
    SGD,
    Adam,
    AdamW,
    Adan,
    CPUAdam,
    FlatParameters,
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
    flatten_parameters,
    prepare_for_gradient_release,
    remove_gradient_release,
)
from lightning_optim.precision import DynamicLossScaler, FP16Optimizer, MasterWeights

# The catalogue's Lightning strategy classes need Lightning: loaded on first access (PEP 562).
__getattr__, __dir__ = _lazy_names(__name__, dict.fromkeys((
    "DecentralizedStrategy",
    "DiLoCoStrategy",
    "FP16CompressStrategy",
    "FTDDPStrategy",
    "FTDiLoCoStrategy",
    "OnebitAdamStrategy",
    "OnebitFSDPStrategy",
    "OnebitLambStrategy",
    "PowerSGDStrategy",
    "RandomKStrategy",
    "SignSGDStrategy",
    "StreamingDiLoCoStrategy",
    "TopKStrategy",
    "ZeroOneAdamStrategy",
), "lightning_optim.lightning"))

__all__ = [
    "SGD",
    "Adam",
    "AdamW",
    "Adan",
    "CPUAdam",
    "CentralizedAdam",
    "CentralizedSGD",
    "CentralizedSparsifiedSGD",
    "CustomCentralizedOptimizer",
    "DecentralizedSGD",
    "DecentralizedStrategy",
    "DiLoCo",
    "DiLoCoStrategy",
    "DynamicLossScaler",
    "FP16CompressStrategy",
    "FP16Optimizer",
    "FTDDPStrategy",
    "FTDiLoCoStrategy",
    "FlatParameters",
    "FusedAdam",
    "FusedLamb",
    "FusedSGD",
    "GenericCentralizedOptimizer",
    "Lamb",
    "Lars",
    "Lion",
    "MasterWeights",
    "OnebitAdam",
    "OnebitAdamStrategy",
    "OnebitFSDPStrategy",
    "OnebitLamb",
    "OnebitLambStrategy",
    "PowerSGD",
    "PowerSGDStrategy",
    "RAdam",
    "RandomKStrategy",
    "Ranger",
    "SignSGD",
    "SignSGDStrategy",
    "SparsifiedSGD",
    "StableAdamW",
    "StreamingDiLoCoStrategy",
    "TopKStrategy",
    "ZeroOneAdam",
    "ZeroOneAdamStrategy",
    "flatten_parameters",
    "prepare_for_gradient_release",
    "remove_gradient_release",
]

# Lightning has no plugin discovery for strategies: "onebit_adam", ... go into the registry of every installed
# Lightning now, last, once everything above is importable (the strategies import this package's modules).
from lightning_optim.extras import installed as _installed  # noqa: E402

if _installed("lightning") or _installed("pytorch_lightning"):
    from lightning_optim.lightning.registry import register_installed as _register_strategies

    _register_strategies()
