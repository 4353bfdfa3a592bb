"""One table of the project's optimizer names: ``name -> class`` and what each can do.

The HF Trainer ``optim`` names (``accel_plugins.hf``) and the Accelerate helper
(``accel_plugins.to_onebit_optimizer``) read it; the names are the Hydra config files' names
(``conf/optimizer/<name>.yaml``) where those exist.
"""

from __future__ import annotations

from dataclasses import dataclass

import lightning_optim as lo
from lightning_optim.onebit import OnebitOptimizer

__all__ = ["OptimizerEntry", "OPTIMIZERS", "ONEBIT", "optimizer_class"]


@dataclass(frozen=True)
class OptimizerEntry:
    name: str
    cls: type
    onebit: bool  # communicates itself (needs the DDP switch)


def _entries() -> dict[str, OptimizerEntry]:
    table = {
        "adam": lo.Adam, "adamw": lo.AdamW, "sgd": lo.SGD, "lamb": lo.Lamb, "lars": lo.Lars, "lion": lo.Lion,
        "adan": lo.Adan, "radam": lo.RAdam, "ranger": lo.Ranger, "stable_adamw": lo.StableAdamW,
        "sign_sgd": lo.SignSGD, "sparsified_sgd": lo.SparsifiedSGD, "cpu_adam": lo.CPUAdam,
        "fused_adam": lo.FusedAdam, "fused_lamb": lo.FusedLamb, "fused_sgd": lo.FusedSGD,
        "onebit_adam": lo.OnebitAdam, "zero_one_adam": lo.ZeroOneAdam, "onebit_lamb": lo.OnebitLamb,
    }
    return {name: OptimizerEntry(name, cls, issubclass(cls, OnebitOptimizer)) for name, cls in table.items()}


OPTIMIZERS: dict[str, OptimizerEntry] = _entries()
ONEBIT: dict[str, type] = {name: e.cls for name, e in OPTIMIZERS.items() if e.onebit}


def optimizer_class(name: str) -> type:
    """The class of ``name``; ``ValueError`` listing the names otherwise."""
    entry = OPTIMIZERS.get(name)
    if entry is None:
        raise ValueError(f"optimizer name {name!r} is not one of lightning_optim's: {', '.join(sorted(OPTIMIZERS))}")
    return entry.cls
