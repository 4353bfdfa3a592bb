"""torch's ``powerSGD_hook`` on CPU buckets of a machine that also has CUDA.

The hook ends each bucket with ``if torch.cuda.is_available(): torch.cuda.synchronize(bucket.device)``
(torch 2.11 and 2.13 alike), which raises ``Expected a cuda device, but got: cpu`` for a gloo run on CPU
tensors on a GPU host (seen on an H100 machine: every PowerSGD step failed). Synchronising a CPU device is
meaningless, so the hook's module is given a view of ``torch`` whose ``cuda.synchronize`` skips non-CUDA
devices; everything else is torch itself, and no other module sees the change.
"""

from __future__ import annotations

import types
from typing import Any

import torch


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


def let_cpu_buckets_through(module: types.ModuleType) -> None:
    """Point ``module``'s global ``torch`` at the view above (idempotent)."""
    if not isinstance(getattr(module, "torch", None), _TorchView):
        module.torch = _TorchView("torch")
