"""A bucket of tensors stepped together (:class:`Batch`) and how a bucket on 16-bit states is cut
into slices for the torch path."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = ["LOW_PRECISION", "Batch", "TORCH_PATH_SLICE", "TensorList", "bucket_slices", "element_chunks"]

LOW_PRECISION = (torch.float16, torch.bfloat16)

# The tensor lists the update math passes around: what torch's foreach ops take, and (as tuples) return.
TensorList = list[Tensor] | tuple[Tensor, ...]


@dataclass
class Batch:
    """Tensors of one param group that are updated together.

    ``raw_grads`` are the gradients as they are (sign flipped for ``maximize``); ``grads`` are
    the same in ``compute_dtype`` (the state dtype), cast on first use so compiled kernels, which
    read 16-bit gradients directly, never pay for the copy. Both may alias ``param.grad`` and must
    not be modified in place.
    """

    params: list[Tensor]
    raw_grads: TensorList
    states: list[dict[str, Any]]
    step: int
    compute_dtype: torch.dtype
    copies: list[Tensor] | None = None  # 16-bit model params that mirror fp32 (master) params
    copies_written: bool = False
    # The bucket's cache of coalesced kernel lists (ops/coalesce.py); None where the bucket has no plan.
    run_cache: dict[str, Any] | None = None
    # True when params and raw grads are known dense and contiguous (the step's one-pass grad read
    # checked them): the kernels' routing then skips its own check.
    contiguous: bool = False
    _params_compute: list[Tensor] | None = field(default=None, repr=False)
    _grads: list[Tensor] | None = field(default=None, repr=False)

    def state(self, key: str) -> list[Tensor]:
        return [s[key] for s in self.states]

    @property
    def grads(self) -> list[Tensor]:
        if self._grads is None:
            dtype = self.compute_dtype
            self._grads = [g if g.dtype == dtype else g.to(dtype) for g in self.raw_grads]
        return self._grads

    @property
    def params_compute(self) -> list[Tensor]:
        """The parameters in the compute dtype (read-only views or copies)."""
        if self._params_compute is None:
            self._params_compute = [p.detach().to(self.compute_dtype) for p in self.params]
        return self._params_compute

    def mark_params_changed(self) -> None:
        """Call before writing the params: drops the cached compute-dtype copies."""
        self._params_compute = None

    def take_copies(self) -> list[Tensor]:
        """For a kernel that writes the rounded 16-bit copies in its own pass ([] when there are none)."""
        if not self.copies:
            return []
        self.copies_written = True
        return self.copies


# Elements per slice of a bucket whose math runs in torch ops (16-bit states, which the compiled
# kernels do not take; optimizers without a kernel; no extension): the foreach path's temporaries
# (Kahan's y/old/new, Adam's deltas, RAdam's ratios) are then bounded by a slice (~7 MB), not the
# bucket (~24 bytes per element: 1.2 GB for 50M bf16 params) -- torch's own for-loop holds one
# tensor's worth at a time, and the first step's peak must not exceed torch's.
TORCH_PATH_SLICE = 1 << 18


def bucket_slices(params: list[Tensor], idx: list[int], torch_path: bool) -> list[tuple[int, int]]:
    """Positions ``[(0, len(idx))]`` of a bucket (a kernel streams it whole), or runs of about
    ``TORCH_PATH_SLICE`` elements when ``torch_path``."""
    if not torch_path or not idx:
        return [(0, len(idx))]
    numels = [params[i].numel() for i in idx]  # only on the torch path: the kernel one stays list-free
    out, start, size = [], 0, 0
    for i, n in enumerate(numels):
        if i > start and size + n > TORCH_PATH_SLICE:
            out.append((start, i))
            start, size = i, 0
        size += n
    out.append((start, len(numels)))
    return out


def element_chunks(param: Tensor, grad: Tensor, state: dict[str, Any],
                   size: int | None = None) -> list[tuple[Tensor, Tensor, dict[str, Any]]] | None:
    """One big tensor as flat pieces of ``size`` elements: ``(param, grad, state)`` views per piece (the
    state's param-shaped tensors cut alike, its scalars shared), for element-wise math on the torch path,
    whose temporaries then stay within a piece; None when something is not contiguous."""
    size = size or TORCH_PATH_SLICE
    size = max(64, size - size % 64)  # whole vectors: each element meets the same SIMD lane and tail as uncut
    shaped = {k: v for k, v in state.items() if isinstance(v, Tensor) and v.shape == param.shape}
    if not all(t.is_contiguous() for t in (param, grad, *shaped.values())):
        return None
    flat_p, flat_g = param.view(-1), grad.view(-1)
    flat_s = {k: v.view(-1) for k, v in shaped.items()}
    return [(flat_p[a : a + size], flat_g[a : a + size], {**state, **{k: v[a : a + size] for k, v in flat_s.items()}})
            for a in range(0, param.numel(), size)]
