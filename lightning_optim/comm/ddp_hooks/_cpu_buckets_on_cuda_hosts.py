"""torch's ``powerSGD_hook`` on CPU buckets of a machine that also has CUDA.

The hook ends each bucket with ``if torch.cuda.is_available(): torch.cuda.synchronize(bucket.device)``
(torch 2.11 and 2.13 alike), which raises ``Expected a cuda device, but got: cpu`` for a gloo run on CPU
tensors on a GPU host (seen on an H100 machine: every PowerSGD step failed). Synchronising a CPU device is
meaningless. So our hook calls torch's own code from a private instance of torch's module: the same source,
executed once more into a module object of our own (never placed in ``sys.modules``), whose global ``torch``
is a view of torch with a ``cuda.synchronize`` that skips non-CUDA devices. torch's module, and every user of
it, stays exactly as torch made it; its classes (``PowerSGDState``) are the ones our hook is given.
"""

from __future__ import annotations

import importlib.util
import types
from typing import Any

import torch

_TORCH_MODULE = "torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook"


class _CudaView(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def synchronize(device: Any = None) -> None:
        if device is not None and torch.device(device).type != "cuda":
            return
        torch.cuda.synchronize(device)


class _TorchView(types.ModuleType):
    cuda = _CudaView("torch.cuda")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def private_powersgd_module() -> types.ModuleType:
    """A fresh instance of torch's ``powerSGD_hook`` module whose ``torch`` global is the view above."""
    spec = importlib.util.find_spec(_TORCH_MODULE)
    if spec is None or spec.loader is None:
        raise ImportError(f"{_TORCH_MODULE} is not importable")
    module = importlib.util.module_from_spec(spec)  # same name and package (its relative imports resolve)
    spec.loader.exec_module(module)
    module.torch = _TorchView("torch")  # type: ignore[attr-defined]  # our own module object, not torch's
    return module
