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
from lightning_optim.optim.validation import check_int, check_positive, plain_numbers

__all__ = ["DynamicLossScaler", "LossScaleUnderflow", "found_non_finite"]


class LossScaleUnderflow(FloatingPointError):
    """The loss scale would fall below ``min_scale``."""


def found_non_finite(grads: Iterable[Tensor], inv_scale: float | None = None) -> Tensor:
    """Local check (and optional in-place unscale ``g <- g * inv_scale``) of ``grads``.

    One fused pass per device (torch's ``_amp_foreach_non_finite_check_and_unscale_``); returns a
    float32 flag on the first grad's device (CPU when there are none): 1.0 if any value is inf/NaN.
    """
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
        max_scale: largest scale, >= init_scale (None: no cap).
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
        init_scale, scale_factor, min_scale, max_scale, backoff_factor = plain_numbers(
            (init_scale, scale_factor, min_scale, max_scale, backoff_factor))
        check_positive("init_scale", init_scale)
        if not isinstance(scale_factor, (int, float)) or isinstance(scale_factor, bool) or not scale_factor > 1:
            raise ValueError(f"scale_factor: must be a number > 1, got {scale_factor!r}")
        check_int("scale_window", scale_window, minimum=1)
        check_positive("min_scale", min_scale)
        if max_scale is not None:
            check_positive("max_scale", max_scale)
            if max_scale < init_scale:
                raise ValueError(f"max_scale: must be >= init_scale ({init_scale}), got {max_scale}")
        if init_scale < min_scale:
            raise ValueError(f"init_scale: must be >= min_scale ({min_scale}), got {init_scale}")
        check_int("hysteresis", hysteresis, minimum=1)
        if backoff_factor is not None and not (isinstance(backoff_factor, (int, float))
                                               and not isinstance(backoff_factor, bool) and 0 < backoff_factor < 1):
            raise ValueError(f"backoff_factor: must be a number in (0, 1), got {backoff_factor!r}")
        self.process_group = check_process_group("process_group", process_group)
        self.scale_factor = float(scale_factor)
        self.backoff_factor = 1.0 / self.scale_factor if backoff_factor is None else float(backoff_factor)
        self.scale_window = int(scale_window)
        self.min_scale = float(min_scale)
        self.max_scale = math.inf if max_scale is None else float(max_scale)
        self.hysteresis = int(hysteresis)
        self.loss_scale = float(init_scale)
        self._clean_steps = 0  # since the last scale change or overflow
        self._overflows_left = self.hysteresis  # overflowing steps tolerated before backing off
        self.skipped_steps = 0

    # ------------------------------------------------------------------ the three calls of a step
    def scale(self, loss: Tensor) -> Tensor:
        """``loss * S`` (backward on it gives scaled gradients)."""
        return loss * self.loss_scale

    def unscale_and_check(self, grads: Iterable[Tensor]) -> bool:
        """Divide ``grads`` by ``S`` in place and return whether any rank saw an inf/NaN."""
        return self.agree(found_non_finite(grads, 1.0 / self.loss_scale))

    def agree(self, found: Tensor | bool) -> bool:
        """The overflow flag, all-reduced (MAX) over the process group when one is up."""
        flag = found if isinstance(found, Tensor) else torch.tensor([float(found)])
        flag = flag.detach().float().reshape(1).clone()
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
        if overflow:
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

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"loss_scale", "clean_steps", "overflows_left"} - set(state)
        if missing:
            raise KeyError(f"state: a DynamicLossScaler state needs {sorted(missing)}")
        scale = float(state["loss_scale"])
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"state: loss_scale must be a finite number > 0, got {scale}")
        self.loss_scale = scale
        self._clean_steps = int(state["clean_steps"])
        self._overflows_left = int(state["overflows_left"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
