"""What the Accelerate adapters share: unwrapping Accelerate's objects and refusing setups that cannot work."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
from torch import nn

from lightning_optim.precision._checks import describe

# Accelerate's distributed types under which the model is a plain module or DDP (the adapters' ground)
_DDP_TYPES = {"NO", "MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA", "MULTI_NPU",
              "MULTI_HPU"}


def check_accelerator(accelerator: Any) -> Any:
    """An ``accelerate.Accelerator`` (the adapters replace its methods and hooks: a stand-in would fail
    half-way, after some were replaced)."""
    from accelerate import Accelerator

    if not isinstance(accelerator, Accelerator):
        raise TypeError(f"accelerator: expected an accelerate.Accelerator (the one that prepared the model), got "
                        f"{describe(accelerator)}")
    return accelerator


def check_model(model: Any) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected the torch.nn.Module accelerator.prepare returned, got {describe(model)}")
    return model


def check_model_and_directory(model: Any, directory: Any) -> None:
    """The arguments every per-rank save/load helper takes besides its optimizer."""
    check_model(model)
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"directory: expected a path (str or os.PathLike), got {describe(directory)}")


def check_owned_params(optimizer: Any, model: nn.Module, extra: Any = ()) -> None:
    """Every trainable param ``optimizer`` steps is a param of ``model`` (or one of ``extra``: its masters).
    An optimizer over another model's params trains without an error and this model never moves."""
    owned = {id(p) for p in unwrap_model(model).parameters()} | {id(t) for t in extra}
    foreign = [f"group {gi} param {i} (shape {tuple(p.shape)})" for gi, g in enumerate(optimizer.param_groups)
               for i, p in enumerate(g["params"]) if p.requires_grad and id(p) not in owned]
    if foreign:
        raise ValueError(f"optimizer: {len(foreign)} of its params are not params of model ({', '.join(foreign[:3])}"
                         f"{', ...' if len(foreign) > 3 else ''}); build the optimizer over model.parameters() of the "
                         "model you pass, and pass both as accelerator.prepare returned them")


def unwrap_optimizer(optimizer: Any) -> Any:
    return getattr(optimizer, "optimizer", optimizer)  # Accelerate's AcceleratedOptimizer wraps it


def unwrap_model(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def distributed_type(accelerator: Any) -> str:
    kind = getattr(accelerator, "distributed_type", "NO")
    return str(getattr(kind, "name", kind))


def check_ddp_ground(caller: str, accelerator: Any, model: nn.Module) -> int:
    """The world size, after refusing what would silently break DDP-based adapters: a process group
    of several ranks that Accelerate left single-process, a sharding engine, an unwrapped model."""
    size, _ = world()
    processes = getattr(accelerator, "num_processes", 1)
    if size > 1 and processes != size:
        raise RuntimeError(
            f"{caller}: a process group of {size} ranks exists but Accelerate runs {processes} process(es) "
            f"(distributed type {distributed_type(accelerator)}): on a CPU-only machine pass "
            "Accelerator(cpu=True) (or ACCELERATE_USE_CPU=1) under torchrun; note that `accelerate launch --cpu "
            "--num_processes 2` starts ONE process (accelerate#2741): use torchrun --nproc_per_node 2")
    kind = distributed_type(accelerator)
    if kind not in _DDP_TYPES:
        raise ValueError(f"{caller}: needs one process or DDP; Accelerate runs {kind}, which shards or steps the "
                         "model itself (DeepSpeed and FSDP have their own mixed precision and communication)")
    if size > 1 and not isinstance(model, nn.parallel.DistributedDataParallel):
        raise TypeError(f"model: pass the model accelerator.prepare returned (a DistributedDataParallel), got "
                        f"{type(model).__name__}")
    return size


class AcceleratorMethods:
    """Instance-level replacements of an Accelerator's methods, put back by :meth:`restore`.

    Accelerate has no hook for what ``clip_grad_norm_`` means; the adapters that change it (master
    weights: clip the fp32 master grads; 1-bit: a rank-agreed norm in the compression stage;
    gradient release: refuse) replace it on this one accelerator. A replacement may wrap the one
    before it (:meth:`current`); ``restore`` puts back what was there.
    """

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator
        self._saved: dict[str, Any] = {}

    def current(self, name: str) -> Any:
        return getattr(self.accelerator, name)

    def replace(self, name: str, function: Any) -> None:
        self._saved[name] = vars(self.accelerator).get(name)  # None: the class's own method
        setattr(self.accelerator, name, function)

    def restore(self) -> None:
        for name, previous in self._saved.items():
            if previous is None:
                vars(self.accelerator).pop(name, None)
            else:
                setattr(self.accelerator, name, previous)
        self._saved.clear()
