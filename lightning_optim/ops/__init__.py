"""Compiled kernels: build/load, backend choice (cuda | cpu | torch) and the kernel lookup.

Optimizers ask for a kernel by name at the top of their ``_update``::

    kernel = ops.kernel("adam", batch)
    if kernel is not None:
        kernel(batch, apply, lr=..., ...)   # the whole bucket in one call
        return
    ...  # the foreach math: the pure-torch fallback, same results

``raw_kernel(name, device)`` gives the flat-buffer kernels of the 1-bit allreduce the same way.
Both return None whenever the torch path must run: backend ``torch`` chosen, the extension
unavailable (one warning, with the reason), a device without kernels, or a batch the kernels do not
cover (fp64, 16-bit states, non-contiguous tensors).

Backend choice: the environment variable ``LIGHTNING_OPTIM_BACKEND``:

* unset or ``auto``: CUDA tensors use the CUDA kernels when the extension was built with CUDA,
  CPU tensors the CPU kernels; the torch fallback otherwise.
* ``torch``: never use the extension.
* ``cpu`` / ``cuda``: use that backend's kernels for tensors on that device, the torch path for
  the others; the extension must build (an error, not a warning, when it does not).

``python -m lightning_optim.ops build`` compiles ahead of time (CI, Docker images).
"""

from __future__ import annotations

import os
import warnings
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from lightning_optim.ops import _loader, custom_ops  # noqa: F401  (custom_ops registers torch.ops.lightning_optim)
from lightning_optim.ops._loader import BuildError, build_root
from lightning_optim.ops.fused import OPTIMIZER_KERNELS, RAW_KERNELS, supports

__all__ = ["BACKENDS", "ENV_VAR", "BuildError", "backend_for", "build", "build_root", "extension", "grads_of",
           "kernel", "raw_kernel", "requested_backend"]

ENV_VAR = "LIGHTNING_OPTIM_BACKEND"
BACKENDS = ("torch", "cpu", "cuda")

_warned = False
_kernels: dict[str, tuple[ModuleType, Any]] = {}  # name -> (the module it was made for, the kernel)


def requested_backend() -> str | None:
    """The backend forced by ``LIGHTNING_OPTIM_BACKEND`` (None: automatic)."""
    raw = os.environ.get(ENV_VAR, "")
    value = raw.strip().lower()
    if value in ("", "auto"):
        return None
    if value not in BACKENDS:
        raise ValueError(f"{ENV_VAR}={raw!r} is not a backend: use one of {', '.join(BACKENDS)} (or auto / unset)")
    return value


def extension(required: bool = False) -> ModuleType | None:
    """The compiled module, built on first use; None (after one warning) when unavailable.

    ``required``: raise RuntimeError instead of warning (a backend was forced).
    """
    global _warned
    try:
        return _loader.build()
    except BuildError as exc:
        if required:
            raise RuntimeError(f"{ENV_VAR}={requested_backend()}: the compiled kernels are unavailable: {exc}") from exc
        if not _warned:
            _warned = True
            warnings.warn(
                f"lightning-optim: compiled kernels unavailable ({exc}); using the pure-torch fallback "
                f"(same results, slower). Set {ENV_VAR}=torch to skip the build and this warning.",
                RuntimeWarning,
                stacklevel=3,
            )
        return None


def backend_for(device: torch.device | str) -> str:
    """``'cuda'``, ``'cpu'`` or ``'torch'``: what runs optimizer math for tensors on ``device``."""
    return _backend_for_kind(torch.device(device).type)


def _constant_while_tracing(fn):
    """``torch.compiler.assume_constant_result`` without its import of ``torch._dynamo`` (seconds of ``import
    lightning_optim`` on plain torch): the mark dynamo reads when it meets the call while tracing
    (tests/ops/test_custom_ops.py holds it to torch's own decorator)."""
    fn._dynamo_marked_constant = True
    return fn


@_constant_while_tracing
def _backend_for_kind(kind: str) -> str:
    """``backend_for`` by device type. torch.compile runs it once while tracing and keeps the answer
    as a constant, so the build, its file checks and the environment lookup stay out of the graph
    (a compiled step keeps the backend it was traced with: after changing the environment variable,
    call ``torch._dynamo.reset()``)."""
    forced = requested_backend()
    if forced == "torch" or kind not in ("cpu", "cuda") or (forced is not None and forced != kind):
        return "torch"
    module = extension(required=forced is not None)
    if module is None:
        return "torch"
    if kind == "cuda" and not module.with_cuda():
        if forced == "cuda":
            raise RuntimeError(f"{ENV_VAR}=cuda: the extension was built without CUDA (torch has no CUDA or nvcc "
                               "was not found at build time)")
        return "torch"
    return kind


def kernel(name: str, batch: Any) -> Any | None:
    """The optimizer kernel ``name`` (``adam``, ``sgd``, ``lion``, ``adan``, ``lamb``, ``lars``,
    ``stableadamw``) for an optimizer ``Batch``, or None: use the torch path (backend, device, or a
    batch the kernels do not cover: fp64, 16-bit states, non-contiguous tensors)."""
    if name not in OPTIMIZER_KERNELS:
        raise KeyError(f"unknown optimizer kernel {name!r}; known: {sorted(OPTIMIZER_KERNELS)}")
    if backend_for(batch.params[0].device) == "torch":
        return None
    module = _loader.build()
    if not supports(batch, module):
        return None
    cached = _kernels.get(name)
    if cached is None or cached[0] is not module:
        cached = _kernels[name] = (module, OPTIMIZER_KERNELS[name](module))
    return cached[1]


def grads_of(params: list[Tensor]) -> tuple[list[Tensor], list[Tensor], bool] | None:
    """``(the params that have a grad, their grads, whether all of both are dense and contiguous)``,
    read in one compiled pass; None where Python reads them instead (torch backend, while tracing, a
    param that is a Tensor subclass). The same objects as ``p.grad``, ~2x faster on cold caches."""
    if not params or not isinstance(params, list) or torch.compiler.is_compiling():
        return None
    if backend_for(params[0].device) == "torch":
        return None
    return _loader.build().grads_of(params)


def loaded_extension() -> ModuleType | None:
    """The compiled module if something already loaded it (never builds; None while tracing)."""
    return None if torch.compiler.is_compiling() else _loader._module


def raw_kernel(name: str, device: torch.device | str) -> Any | None:
    """The flat-buffer kernel ``name`` (the 1-bit passes: ``onebit_seg_sumsq``, ``onebit_seg_compress``,
    ``onebit_seg_unpack``, ``onebit_server_mean``, ``onebit_unpack_table``) for tensors on ``device``,
    or None: use the torch path."""
    if name not in RAW_KERNELS:
        raise KeyError(f"unknown flat kernel {name!r}; known: {sorted(RAW_KERNELS)}")
    if backend_for(device) == "torch":
        return None
    return getattr(_loader.build(), name)


def build(verbose: bool = False, force: bool = False) -> ModuleType:
    """Compile now (raises BuildError with the reason on failure)."""
    return _loader.build(verbose=verbose, force=force)
