"""fp32 master weights for a model trained in fp16/bf16.

The model keeps 16-bit params (forward and backward run in 16 bits); the optimizer steps fp32
copies (the masters), so small updates are not lost to rounding. One step:

1. ``grads_to_masters(scale)``: ``m.grad <- float(p.grad) / S`` and the inf/NaN check, one fused
   pass over the master grads (torch's AMP kernel); the 16-bit grads are freed. Clipping and the
   global-norm optimizers (LAMB) see these unscaled fp32 gradients.
2. the optimizer steps the masters (skipped on overflow).
3. ``p <- round16(m)``. Our optimizers write it in the same pass as their update (``param_copies``:
   the compiled Adam/AdamW kernel reads the master once and writes both; the others copy each
   bucket right after its update); for any other optimizer ``masters_to_model`` copies afterwards.

fp32 params of the model (norms kept in fp32, say) are their own masters: no copy, no extra memory.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_optim.precision.loss_scaler import DynamicLossScaler, found_non_finite

__all__ = ["MasterWeights"]

LOW_PRECISION = (torch.float16, torch.bfloat16)


class MasterWeights:
    """fp32 masters of ``params`` (the trainable params of a 16-bit model) and the copies between them."""

    def __init__(self, params: Iterable[Tensor]) -> None:
        self.model_params = [p for p in params if p.requires_grad]
        if not self.model_params:
            raise ValueError("params: no trainable parameters")
        for p in self.model_params:
            if not p.is_floating_point():
                raise TypeError(f"params: only floating-point parameters can have masters (got {p.dtype})")
        self.masters: list[Tensor] = [
            nn.Parameter(p.detach().float().clone()) if p.dtype in LOW_PRECISION else p for p in self.model_params
        ]
        self._copied = [(p, m) for p, m in zip(self.model_params, self.masters) if m is not p]
        self._master_of = {id(p): m for p, m in zip(self.model_params, self.masters)}
        self._grad_buffers: dict[int, Tensor] = {}

    # ------------------------------------------------------------------ wiring into an optimizer
    def master_of(self, p: Tensor) -> Tensor:
        return self._master_of[id(p)]

    def swap_into(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer`` (built over the model's params) step the masters instead.

        Params that have no master (frozen ones) are left as they are. Existing per-param state
        moves with its param. Our optimizers also learn where to write the rounded 16-bit copies.
        """
        for group in optimizer.param_groups:
            swapped = []
            for p in group["params"]:
                m = self._master_of.get(id(p), p)
                if m is not p and p in optimizer.state:
                    optimizer.state[m] = optimizer.state.pop(p)
                swapped.append(m)
            group["params"] = swapped
        if getattr(optimizer, "writes_param_copies", False):
            optimizer.set_param_copies([(m, p) for p, m in self._copied])
        for attr in ("_group_index", "_layout"):
            if getattr(optimizer, attr, None) is not None:
                setattr(optimizer, attr, None)  # lookups keyed by the old params
        getattr(optimizer, "_plans", {}).clear()

    # ------------------------------------------------------------------ the copies of a step
    @torch.no_grad()
    def grads_to_masters(self, inv_scale: float = 1.0) -> Tensor:
        """``m.grad <- p.grad * inv_scale`` in fp32 and the local inf/NaN flag (1.0: found).

        Params without a gradient give their master none. The 16-bit grads are freed.
        """
        grads = []
        for p, m in zip(self.model_params, self.masters):
            g = p.grad
            if g is None:
                if m is not p:
                    m.grad = None
                continue
            if m is not p:
                # one fp32 buffer per master for the whole run: optimizer.zero_grad() sets m.grad to
                # None every step, and a fresh 4 B/param allocation each step costs page faults
                buffer = self._grad_buffers.get(id(m))
                if buffer is None:
                    buffer = self._grad_buffers[id(m)] = torch.empty_like(m)
                m.grad = buffer.copy_(g)
                p.grad = None
            grads.append(m.grad)
        return found_non_finite(grads, inv_scale)

    @torch.no_grad()
    def masters_to_model(self) -> None:
        """``p <- round16(m)`` for every param with a separate master."""
        if self._copied:
            torch._foreach_copy_([p for p, _ in self._copied], [m for _, m in self._copied])

    def step(self, optimizer: torch.optim.Optimizer, scaler: DynamicLossScaler | None = None,
             max_grad_norm: float | None = None) -> bool:
        """One whole master-weights step after ``backward`` (on ``scaler.scale(loss)`` when a scaler is given).

        Unscales into the masters; with a scaler, an inf/NaN on any rank skips the step everywhere
        and backs the scale off (without one, NaN/Inf flow into the update as in torch). Clips the
        fp32 master grads to ``max_grad_norm``, steps, and rounds the masters into the model.
        Returns whether the optimizer stepped.
        """
        found = self.grads_to_masters(1.0 if scaler is None else 1.0 / scaler.loss_scale)
        if scaler is not None:
            overflow = scaler.agree(found)
            scaler.update(overflow)
            if overflow:
                self.zero_master_grads()
                return False
        if max_grad_norm is not None:
            nn.utils.clip_grad_norm_([m for m in self.masters if m.grad is not None], max_grad_norm)
        optimizer.step()
        self.after_step(optimizer)
        return True

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Round the masters into the model, unless ``optimizer`` already wrote the copies in its step."""
        if not (getattr(optimizer, "writes_param_copies", False) and getattr(optimizer, "_param_copies", None)):
            self.masters_to_model()

    def zero_master_grads(self) -> None:
        for m in self.masters:
            m.grad = None

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The masters (the model's own state dict holds only their rounded copies)."""
        return {"masters": [m.detach().clone() for _, m in self._copied]}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("masters")
        if not isinstance(saved, (list, tuple)) or len(saved) != len(self._copied):
            raise ValueError(f"state: expected {len(self._copied)} master tensors, got "
                             f"{len(saved) if isinstance(saved, (list, tuple)) else type(saved).__name__}")
        for i, ((_, m), t) in enumerate(zip(self._copied, saved)):
            if not isinstance(t, Tensor) or t.shape != m.shape:
                raise ValueError(f"state: master {i} has shape {getattr(t, 'shape', None)}, expected {tuple(m.shape)}")
        for (_, m), t in zip(self._copied, saved):
            m.copy_(t)
        self.masters_to_model()
