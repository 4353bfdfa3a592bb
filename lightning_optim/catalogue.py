"""One table of the project's names: optimizers and Lightning strategies, ``name -> class`` and what each can do.

Everything that names them reads it: the top-level exports (``lightning_optim.<Class>``), the Lightning
strategy registry (``strategy="onebit_adam"``), the Hydra config groups (``conf/optimizer/<name>.yaml``,
``conf/strategy/<name>.yaml``, checked against it by the tests), the HF Trainer ``optim`` names
(``accel_plugins.hf``) and the Accelerate helper (``accel_plugins.to_onebit_optimizer``).

This module imports nothing of the package at import time (``lightning_optim/__init__`` reads it first);
``entry.cls`` imports the class on first use.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

__all__ = ["OptimizerEntry", "StrategyEntry", "OPTIMIZERS", "DISTRIBUTED", "STRATEGIES", "OPTIMIZER_ALIASES",
           "STRATEGY_ALIASES", "optimizer_class", "optimizer_name", "strategy_name"]


def _resolve(target: str) -> type:
    module, _, name = target.rpartition(".")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class OptimizerEntry:
    name: str
    target: str  # import path of the class, also the Hydra config's ``_target_``
    onebit: bool = False  # communicates by itself: DDP's allreduce must be switched off in its compression stage

    @property
    def export(self) -> str:
        """The class's name at the top level of ``lightning_optim``."""
        return self.target.rpartition(".")[2]

    @property
    def cls(self) -> type:
        return _resolve(self.target)


@dataclass(frozen=True)
class StrategyEntry:
    name: str
    export: str  # the class name in lightning_optim.lightning (and .pl_strategies for pytorch_lightning)
    description: str
    optimizer: str | None = None  # the catalogue name of the 1-bit optimizer it converts to (None: any optimizer)
    base: str = "DDPStrategy"  # the Lightning strategy it extends (ModelParallelStrategy: FSDP2)


_OPT = "lightning_optim.optim."
_ONEBIT = "lightning_optim.onebit."

OPTIMIZERS: dict[str, OptimizerEntry] = {e.name: e for e in (
    OptimizerEntry("adam", _OPT + "Adam"),
    OptimizerEntry("adamw", _OPT + "AdamW"),
    OptimizerEntry("sgd", _OPT + "SGD"),
    OptimizerEntry("lamb", _OPT + "Lamb"),
    OptimizerEntry("lars", _OPT + "Lars"),
    OptimizerEntry("lion", _OPT + "Lion"),
    OptimizerEntry("adan", _OPT + "Adan"),
    OptimizerEntry("radam", _OPT + "RAdam"),
    OptimizerEntry("ranger", _OPT + "Ranger"),
    OptimizerEntry("stable_adamw", _OPT + "StableAdamW"),
    OptimizerEntry("sign_sgd", _OPT + "SignSGD"),
    OptimizerEntry("sparsified_sgd", _OPT + "SparsifiedSGD"),
    OptimizerEntry("cpu_adam", _OPT + "CPUAdam"),
    OptimizerEntry("fused_adam", _OPT + "FusedAdam"),
    OptimizerEntry("fused_lamb", _OPT + "FusedLamb"),
    OptimizerEntry("fused_sgd", _OPT + "FusedSGD"),
    OptimizerEntry("onebit_adam", _ONEBIT + "OnebitAdam", onebit=True),
    OptimizerEntry("zero_one_adam", _ONEBIT + "ZeroOneAdam", onebit=True),
    OptimizerEntry("onebit_lamb", _ONEBIT + "OnebitLamb", onebit=True),
)}

_DIST = "lightning_optim.distributed."

# mlbench-core's distributed optimizers and DiLoCo (a wrapper over any local optimizer): built over a
# model, params or an inner optimizer and a process group, they communicate in step(); exported at the top level
# (lazily), not HF/Hydra ``optimizer`` names.
DISTRIBUTED: dict[str, OptimizerEntry] = {e.name: e for e in (
    OptimizerEntry("generic_centralized", _DIST + "GenericCentralizedOptimizer"),
    OptimizerEntry("centralized_sgd", _DIST + "CentralizedSGD"),
    OptimizerEntry("centralized_adam", _DIST + "CentralizedAdam"),
    OptimizerEntry("custom_centralized", _DIST + "CustomCentralizedOptimizer"),
    OptimizerEntry("centralized_sparsified_sgd", _DIST + "CentralizedSparsifiedSGD"),
    OptimizerEntry("powersgd", _DIST + "PowerSGD"),
    OptimizerEntry("decentralized_sgd", _DIST + "DecentralizedSGD"),
    OptimizerEntry("diloco", _DIST + "DiLoCo"),
)}

STRATEGIES: dict[str, StrategyEntry] = {e.name: e for e in (
    StrategyEntry("onebit_adam", "OnebitAdamStrategy",
                  "DDP + 1-bit Adam (lightning_optim): fp32 warmup, then 1-bit compressed momentum", "onebit_adam"),
    StrategyEntry("zero_one_adam", "ZeroOneAdamStrategy",
                  "DDP + 0/1 Adam (lightning_optim): sparse variance updates, 1-bit synchronised local steps",
                  "zero_one_adam"),
    StrategyEntry("onebit_lamb", "OnebitLambStrategy",
                  "DDP + 1-bit LAMB (lightning_optim): fp32 warmup, then 1-bit compressed momentum", "onebit_lamb"),
    StrategyEntry("powersgd", "PowerSGDStrategy",
                  "DDP + torch's PowerSGD comm hook on every device (lightning_optim): low-rank gradients, error "
                  "feedback, per-rank state in checkpoints"),
    StrategyEntry("topk", "TopKStrategy",
                  "DDP + top-k sparsified gradients with error feedback (lightning_optim): values + indices "
                  "all-gathered"),
    StrategyEntry("randomk", "RandomKStrategy",
                  "DDP + random-k sparsified gradients with error feedback (lightning_optim)"),
    StrategyEntry("sign_sgd", "SignSGDStrategy",
                  "DDP + EF-SignSGD (lightning_optim): scaled 1-bit signs with error feedback, or majority vote"),
    StrategyEntry("decentralized", "DecentralizedStrategy",
                  "Decentralized SGD (lightning_optim): local gradients, then gossip of the params with neighbours "
                  "(ring, torus, exponential, explicit)"),
    StrategyEntry("fp16_compress", "FP16CompressStrategy",
                  "DDP + torch's fp16_compress_hook on every device (lightning_optim): buckets averaged in fp16"),
    StrategyEntry("diloco", "DiLoCoStrategy",
                  "DiLoCo (lightning_optim): local steps of any optimizer, an outer Nesterov step on the averaged "
                  "parameter change every sync_every steps; no gradient all-reduce"),
    StrategyEntry("streaming_diloco", "StreamingDiLoCoStrategy",
                  "Streaming DiLoCo (lightning_optim): DiLoCo in fragments, one synchronised every "
                  "sync_every/fragments steps, overlapped with the next step"),
    StrategyEntry("ft_diloco", "FTDiLoCoStrategy",
                  "Fault-tolerant DiLoCo across replica groups on torchft (lightning_optim): one process per replica, "
                  "each synchronisation a quorum of the replicas alive; a dead replica costs one exchange"),
    StrategyEntry("ft_ddp", "FTDDPStrategy",
                  "Fault-tolerant data parallelism across replica groups on torchft (lightning_optim): one process "
                  "per replica, every step a quorum, gradients averaged over the replicas alive"),
    StrategyEntry("onebit_fsdp", "OnebitFSDPStrategy",
                  "HSDP (FSDP2 on a replicate x shard mesh) + 1-bit Adam across the replicas (lightning_optim): "
                  "HSDP's fp32 all-reduce in warmup, then the 1-bit compressed momentum exchange", "onebit_adam",
                  base="ModelParallelStrategy"),
)}


# Old names that still work everywhere a name is taken (Hydra option, HF ``optim``, Lightning ``strategy=``):
# each resolves to its new name with one FutureWarning. An old name is never a current one.
OPTIMIZER_ALIASES: dict[str, str] = {"signsgd": "sign_sgd", "stableadamw": "stable_adamw"}
STRATEGY_ALIASES: dict[str, str] = {"signsgd": "sign_sgd"}


def optimizer_name(name: str) -> str:
    """``name``, or the name an old one (:data:`OPTIMIZER_ALIASES`) now has, with a ``FutureWarning``."""
    if name in OPTIMIZER_ALIASES:
        from lightning_optim.renames import warn_renamed

        warn_renamed("optimizer name", name, OPTIMIZER_ALIASES[name])
        return OPTIMIZER_ALIASES[name]
    return name


def strategy_name(name: str) -> str:
    """``name``, or the name an old one (:data:`STRATEGY_ALIASES`) now has, with a ``FutureWarning``."""
    if name in STRATEGY_ALIASES:
        from lightning_optim.renames import warn_renamed

        warn_renamed("strategy", name, STRATEGY_ALIASES[name])
        return STRATEGY_ALIASES[name]
    return name


def optimizer_class(name: str) -> type:
    """The class of ``name`` (an old name warns, see :func:`optimizer_name`); ``ValueError`` listing the names
    otherwise."""
    entry = OPTIMIZERS.get(optimizer_name(name))
    if entry is None:
        raise ValueError(f"optimizer name {name!r} is not one of lightning_optim's: {', '.join(sorted(OPTIMIZERS))}")
    return entry.cls
