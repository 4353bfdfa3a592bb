"""Dynamic loss scaling for fp16 training, with the overflow decision agreed on every rank.

fp16 gradients underflow below 6e-8; multiplying the loss by a scale ``S`` moves them into range,
and the gradients are divided by ``S`` again before the update. ``S`` adapts:

* a step whose gradients hold an inf/NaN on **any** rank is skipped by **every** rank, and after
  ``hysteresis`` such steps in a row ``S <- S * backoff_factor`` (default ``1 / scale_factor``);
* after ``scale_window`` consecutive clean steps ``S <- min(S * scale_factor, max_scale)``;
* a back-off below ``min_scale`` raises :class:`LossScaleUnderflow` (the model produces non-finite
  gradients at any scale: a diverged run, not a scaling problem).

Why agreed: in the 1-bit optimizers' compression stage each rank steps on its own local
gradients, so one rank may overflow while the others do not. A local skip would desynchronise the
ranks (different step counts, different collectives). The flag is all-reduced (MAX) over the
process group, one 4-byte collective per step, bounded by ``collective_timeout()``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_optim.comm.timeouts import check_process_group, collective
from lightning_optim.precision._checks import (
    check_bool,
    check_count,
    check_keys,
    check_label,
    check_number,
    check_tensor_list,
)

__all__ = ["DynamicLossScaler", "LossScaleUnderflow", "found_non_finite"]


class LossScaleUnderflow(FloatingPointError):
    """The loss scale would fall below ``min_scale``."""


def found_non_finite(grads: Iterable[Tensor], inv_scale: float | None = None) -> Tensor:
    """Local check (and optional in-place unscale ``g <- g * inv_scale``) of ``grads``.

    One fused pass per device (torch's ``_amp_foreach_non_finite_check_and_unscale_``); returns a
    float32 flag on the first grad's device (CPU when there are none): 1.0 if any value is inf/NaN.
    """
    grads = check_tensor_list("grads", grads)
    if inv_scale is not None:
        inv_scale = check_number("inv_scale", inv_scale, above=0.0)
    by_device: dict[torch.device, list[Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    device = next(iter(by_device), torch.device("cpu"))
    found = torch.zeros(1, dtype=torch.float32, device=device)
    for dev, tensors in by_device.items():
        local = torch.zeros(1, dtype=torch.float32, device=dev)
        inv = torch.full((1,), 1.0 if inv_scale is None else inv_scale, dtype=torch.float32, device=dev)
        # the fused op wants same-dtype lists; fp32 master grads are the common case
        for dtype in {t.dtype for t in tensors}:
            torch._amp_foreach_non_finite_check_and_unscale_([t for t in tensors if t.dtype == dtype], local, inv)
        found = torch.maximum(found, local.to(device))
    return found


class DynamicLossScaler:
    r"""Loss scale with back-off on overflow and growth after clean windows.

    .. math::
        S \leftarrow \begin{cases}
            S \cdot b & \text{overflow on any rank, the } h\text{-th in a row} \\
            \min(S \cdot f, S_{max}) & \text{after } w \text{ clean steps since the last change} \\
            S & \text{otherwise}
        \end{cases}

    Args:
        init_scale: the first scale, > 0.
        scale_factor: growth factor ``f``, > 1.
        scale_window: clean steps ``w`` before growing, >= 1.
        min_scale: smallest allowed scale, > 0; backing off below it raises.
        max_scale: largest scale, >= init_scale (None or inf: no cap).
        hysteresis: overflowing steps ``h`` in a row before backing off, >= 1 (DeepSpeed's
            ``delayed_shift``); every overflowing step is skipped regardless.
        backoff_factor: ``b``, in (0, 1) (None: ``1 / scale_factor``).
        process_group: the group whose ranks must agree (None: the default group when one is up).
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        scale_factor: float = 2.0,
        scale_window: int = 2000,
        min_scale: float = 1e-4,
        max_scale: float | None = None,
        hysteresis: int = 1,
        *,
        backoff_factor: float | None = None,
        process_group: Any = None,
    ) -> None:
        init_scale = check_number("init_scale", init_scale, above=0.0)
        scale_factor = check_number("scale_factor", scale_factor, above=1.0)
        scale_window = check_count("scale_window", scale_window, minimum=1)
        min_scale = check_number("min_scale", min_scale, above=0.0)
        max_scale = math.inf if max_scale is None else check_number("max_scale", max_scale, above=0.0, allow_inf=True)
        if max_scale < init_scale:
            raise ValueError(f"max_scale: must be >= init_scale ({init_scale:g}), got {max_scale:g}")
        if init_scale < min_scale:
            raise ValueError(f"init_scale: must be >= min_scale ({min_scale:g}), got {init_scale:g}")
        hysteresis = check_count("hysteresis", hysteresis, minimum=1)
        if backoff_factor is not None:
            backoff_factor = check_number("backoff_factor", backoff_factor, above=0.0, below=1.0)
        self.process_group = check_process_group("process_group", process_group)
        self.scale_factor = scale_factor
        self.backoff_factor = 1.0 / scale_factor if backoff_factor is None else backoff_factor
        self.scale_window = scale_window
        self.min_scale = min_scale
        self.max_scale = max_scale
        self.hysteresis = hysteresis
        self.loss_scale = init_scale
        self._clean_steps = 0  # since the last scale change or overflow
        self._overflows_left = self.hysteresis  # overflowing steps tolerated before backing off
        self.skipped_steps = 0

    # ------------------------------------------------------------------ the three calls of a step
    def scale(self, loss: Tensor) -> Tensor:
        """``loss * S`` (backward on it gives scaled gradients)."""
        _check_loss(loss)
        return loss * self.loss_scale

    def unscale_and_check(self, grads: Iterable[Tensor]) -> bool:
        """Divide ``grads`` by ``S`` in place and return whether any rank saw an inf/NaN."""
        return self.agree(found_non_finite(grads, 1.0 / self.loss_scale))

    def agree(self, found: Tensor | bool) -> bool:
        """The overflow flag, all-reduced (MAX) over the process group when one is up."""
        if isinstance(found, Tensor):
            if found.numel() != 1 or found.is_complex():
                raise ValueError(f"found: must be a one-element real tensor (a flag), got {found.dtype} of shape "
                                 f"{tuple(found.shape)}")
            flag = found.detach().float().reshape(1).clone()
        else:
            flag = torch.tensor([float(check_bool("found", found))])
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.process_group) > 1:
            if dist.get_backend(self.process_group) == "gloo" and flag.device.type != "cpu":
                flag = flag.cpu()
            collective("loss-scale overflow agreement", dist.all_reduce, flag, op=dist.ReduceOp.MAX,
                       group=self.process_group)
        return bool(flag.item() > 0)

    def update(self, overflow: bool) -> None:
        """Record one step: back off (or count towards it) on overflow, else grow when due.

        Raises :class:`LossScaleUnderflow` (nothing changed) when backing off would go below ``min_scale``.
        """
        if check_bool("overflow", overflow):
            self.skipped_steps += 1
            self._clean_steps = 0
            if self._overflows_left > 1:
                self._overflows_left -= 1
                return
            new_scale = self.loss_scale * self.backoff_factor
            if new_scale < self.min_scale:
                raise LossScaleUnderflow(
                    f"loss scale would fall to {new_scale:g}, below min_scale={self.min_scale:g}: the gradients "
                    "are non-finite at every scale tried (the run has diverged: lower the learning rate, check "
                    "the data, or pass a smaller min_scale)")
            self.loss_scale = new_scale
            self._overflows_left = self.hysteresis
            return
        self._clean_steps += 1
        self._overflows_left = self.hysteresis
        if self._clean_steps >= self.scale_window:
            self.loss_scale = min(self.loss_scale * self.scale_factor, self.max_scale)
            self._clean_steps = 0

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"loss_scale": self.loss_scale, "clean_steps": self._clean_steps,
                "overflows_left": self._overflows_left, "skipped_steps": self.skipped_steps}

    def check_state_dict(self, state: Any, where: str = "state") -> dict[str, Any]:
        """``state`` checked for this scaler (what :meth:`load_state_dict` would load); changes nothing.

        Keys: ``loss_scale`` in [min_scale, max_scale], ``clean_steps`` an int >= 0, ``overflows_left``
        an int in [1, hysteresis], optional ``skipped_steps`` an int >= 0 (numpy scalars count).
        """
        check_label("where", where)
        check_keys(where, state, {"loss_scale", "clean_steps", "overflows_left"}, {"skipped_steps"})
        scale = check_number(f"{where}['loss_scale']", state["loss_scale"], above=0.0)
        if not self.min_scale <= scale <= self.max_scale:
            raise ValueError(f"{where}['loss_scale']: must be in [min_scale, max_scale] = [{self.min_scale:g}, "
                             f"{self.max_scale:g}] of this scaler, got {scale:g}")
        return {"loss_scale": scale,
                "clean_steps": check_count(f"{where}['clean_steps']", state["clean_steps"]),
                "overflows_left": check_count(f"{where}['overflows_left']", state["overflows_left"], minimum=1,
                                              maximum=self.hysteresis),
                "skipped_steps": check_count(f"{where}['skipped_steps']", state.get("skipped_steps", 0))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Every key is checked (:meth:`check_state_dict`) before any is assigned."""
        checked = self.check_state_dict(state)
        self.loss_scale = checked["loss_scale"]
        self._clean_steps = checked["clean_steps"]
        self._overflows_left = checked["overflows_left"]
        self.skipped_steps = checked["skipped_steps"]


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, Tensor) or not loss.is_floating_point():
        raise TypeError(f"loss: expected a floating-point Tensor, got "
                        f"{loss.dtype if isinstance(loss, Tensor) else type(loss).__name__}")
