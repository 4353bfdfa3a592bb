"""mlbench-core's ``FP16Optimizer``: an fp16 model, one flat fp32 master, dynamic loss scaling.

mlbench code runs unchanged::

    fp = FP16Optimizer(model.half(), world_size, average_world=True)
    opt = AdamW([fp.fp32_params])           # any torch or lightning_optim optimizer
    fp.set_optimizer(opt)
    fp.backward_loss(loss)                  # backward on loss * S
    updated = fp.step()                     # False: an overflow step, skipped everywhere
    fp.zero_grad()

A step: the fp16 grads are gathered into the flat fp32 gradient, summed over the ranks when a
process group is up and divided by ``world_size`` (``average_world``) or by the given ``denom``
summed over the ranks (``average_custom``), before or after the sum (``divide_before``), then
unscaled, ``g <- g / (S * multiplier)``; an inf/NaN (agreed by every rank) skips the step and backs
the scale off, otherwise ``grad_clip`` clips the fp32 gradient norm, the optimizer steps the master
and the master is rounded into the model.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_optim.comm.timeouts import collective
from lightning_optim.optim.validation import is_bool
from lightning_optim.precision._checks import (
    check_bool,
    check_callable,
    check_count,
    check_keys,
    check_number,
    check_optimizer,
    check_optimizer_state,
    describe,
)
from lightning_optim.precision.loss_scaler import DynamicLossScaler

__all__ = ["FP16Optimizer"]


def _trained(model: nn.Module) -> list[Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


class FP16Optimizer:
    """Mixed-precision wrapper with mlbench-core's constructor and methods (see the module doc).

    Args:
        fp16_model: the model, already cast to half.
        world_size: ranks the gradients are averaged over (>= 1; the process group's size when one is up).
        use_cuda: the model lives on a CUDA device (checked against the params).
        use_horovod: not supported (Horovod is not a torch.distributed backend): must be False.
        by_layer: one all-reduce per parameter instead of one over the flat gradient.
        grad_clip: max L2 norm of the unscaled fp32 gradient (inf: no clipping).
        init_scale, scale_factor, scale_window, max_scale, min_scale: the :class:`DynamicLossScaler`.
        average_world: divide the summed gradient by ``world_size``.
        average_custom: divide it by ``denom`` (given to :meth:`step`) summed over the ranks.
        divide_before: divide before the all-reduce instead of after it.
    """

    def __init__(
        self,
        fp16_model: nn.Module,
        world_size: int,
        use_cuda: bool = False,
        use_horovod: bool = False,
        by_layer: bool = False,
        grad_clip: float = float("inf"),
        init_scale: float = 1024,
        scale_factor: float = 2,
        scale_window: int = 128,
        max_scale: float | None = None,
        min_scale: float = 1e-4,
        average_world: bool = False,
        average_custom: bool = False,
        divide_before: bool = False,
    ) -> None:
        _check_module(fp16_model)
        world_size = check_count("world_size", world_size, minimum=1)
        use_cuda, use_horovod, by_layer, average_world, average_custom, divide_before = (
            check_bool(name, flag) for name, flag in (
                ("use_cuda", use_cuda), ("use_horovod", use_horovod), ("by_layer", by_layer),
                ("average_world", average_world), ("average_custom", average_custom), ("divide_before", divide_before)))
        if use_horovod:
            raise ValueError("use_horovod: Horovod is not supported; FP16Optimizer aggregates with torch.distributed "
                             "(any backend: gloo, NCCL). Pass use_horovod=False and launch with torchrun")
        if average_world and average_custom:
            raise ValueError("average_world and average_custom: give one of them (divide by world_size or by denom)")
        grad_clip = check_number("grad_clip", grad_clip, above=0.0, allow_inf=True)
        loss_scaler = DynamicLossScaler(init_scale, scale_factor, scale_window, min_scale, max_scale)  # names them
        params = _trained(fp16_model)
        if not params:
            raise ValueError("fp16_model: has no trainable parameters")
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ValueError(f"fp16_model: all parameters must be on one device, found {sorted(map(str, devices))}")
        on_cuda = next(iter(devices)).type == "cuda"
        if use_cuda != on_cuda:
            raise ValueError(f"use_cuda={use_cuda} but the model's parameters are on {next(iter(devices))}")
        if _distributed() and dist.get_world_size() != world_size:
            raise ValueError(f"world_size: {world_size} given, but the process group has {dist.get_world_size()} ranks")
        if not _distributed() and world_size > 1:
            raise ValueError(f"world_size: {world_size} given, but no process group is initialised (call "
                             "torch.distributed.init_process_group first, e.g. under torchrun)")
        if world_size > 1 and not (average_world or average_custom):
            raise ValueError("average_world / average_custom: with world_size > 1 the summed gradient must be "
                             "averaged; pass average_world=True (or average_custom=True with step(denom=...))")
        self.fp16_model = fp16_model
        self.world_size = world_size
        self.use_cuda = use_cuda
        self.by_layer = by_layer
        self.grad_clip = grad_clip
        self.average_world = average_world
        self.average_custom = average_custom
        self.divide_before = divide_before
        self.loss_scaler = loss_scaler
        self.fp32_params = self.initialize_flat_fp32_weight()
        self.optimizer: torch.optim.Optimizer | None = None

    # ------------------------------------------------------------------ mlbench's static copies
    @staticmethod
    @torch.no_grad()
    def fp16_to_fp32_flat_grad(fp32_params: Tensor, fp16_model: nn.Module) -> None:
        """``fp32_params.grad <- concat(p.grad)`` over the trained params (zeros where a grad is None)."""
        _check_flat(fp32_params, fp16_model)
        if fp32_params.grad is None:
            fp32_params.grad = torch.zeros_like(fp32_params)
        offset = 0
        for p in _trained(fp16_model):
            view = fp32_params.grad[offset:offset + p.numel()].view_as(p)
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad)
            offset += p.numel()

    @staticmethod
    @torch.no_grad()
    def fp32_to_fp16_weights(fp16_model: nn.Module, fp32_params: Tensor) -> None:
        """``p <- round16(slice of fp32_params)`` for every trained param."""
        _check_flat(fp32_params, fp16_model)
        offset = 0
        for p in _trained(fp16_model):
            p.copy_(fp32_params[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

    def initialize_flat_fp32_weight(self) -> nn.Parameter:
        """One flat fp32 parameter holding every trained param of the model (with a zero grad)."""
        params = _trained(self.fp16_model)
        flat = torch.cat([p.detach().reshape(-1).float() for p in params])
        master = nn.Parameter(flat)
        master.grad = torch.zeros_like(flat)
        return master

    # ------------------------------------------------------------------ training calls
    def set_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer that steps ``fp32_params`` (built as ``Cls([fp.fp32_params], ...)``)."""
        check_optimizer("optimizer", optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if not any(p is self.fp32_params for p in params):
            raise ValueError("optimizer: it must optimize fp32_params (build it as Cls([fp.fp32_params], ...))")
        if any(p is not self.fp32_params and p.requires_grad for p in params):
            raise ValueError("optimizer: it must optimize fp32_params only (any other param it steps would get a "
                             "gradient scaled by the loss scale); build it as Cls([fp.fp32_params], ...)")
        self.optimizer = optimizer

    def backward_loss(self, loss: Tensor) -> None:
        """``(loss * S).backward()``."""
        self.loss_scaler.scale(loss).backward()  # scale() refuses a loss that is not a float tensor

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, tracker: Any = None, multiplier: float = 1,
             denom: Tensor | float | None = None) -> bool:
        """Aggregate, unscale, check, clip and step (see the module doc); returns whether it updated.

        ``multiplier``: the gradient is divided by ``S * multiplier``. ``denom``: this rank's
        denominator for ``average_custom`` (summed over the ranks).
        """
        if self.optimizer is None:
            raise RuntimeError("step: call set_optimizer(optimizer) first")
        # everything is checked before the scaler or any gradient changes
        check_callable("closure", closure)
        _check_tracker(tracker)
        multiplier = check_number("multiplier", multiplier, above=0.0)
        if self.average_custom and denom is None:
            raise ValueError("denom: required with average_custom=True")
        if denom is not None and not self.average_custom:
            raise ValueError("denom: only used with average_custom=True")
        if denom is not None:
            _check_denom(denom)
        _check_flat(self.fp32_params, self.fp16_model)  # the model's trained params are still those of the master
        divisor = self._divisor(denom)
        self.fp16_to_fp32_flat_grad(self.fp32_params, self.fp16_model)
        grad = cast(Tensor, self.fp32_params.grad)  # just filled
        self._aggregate(grad, divisor)
        _record(tracker, "record_batch_agg")
        if multiplier != 1:
            grad.div_(multiplier)
        overflow = self.loss_scaler.unscale_and_check([grad])
        if overflow:
            self.loss_scaler.update(True)
        else:
            if math.isfinite(self.grad_clip):
                nn.utils.clip_grad_norm_([self.fp32_params], self.grad_clip)
            with torch.enable_grad():
                self.optimizer.step(closure) if closure is not None else self.optimizer.step()
            self.fp32_to_fp16_weights(self.fp16_model, self.fp32_params)
            self.loss_scaler.update(False)  # after the step went through: a refused step leaves the scale as it was
        _record(tracker, "record_batch_opt_step")
        return not overflow

    def zero_grad(self) -> None:
        """Reset the model's fp16 grads and the master gradient."""
        self.fp16_model.zero_grad(set_to_none=True)
        if self.fp32_params.grad is not None:
            self.fp32_params.grad.zero_()

    def _divisor(self, denom: Tensor | float | None) -> float:
        """What the summed gradient is divided by: ``world_size``, the ``denom`` summed over the ranks, or 1.
        A bad denom on any rank is refused on every rank together, before any gradient changes."""
        if self.average_world:
            return float(self.world_size)
        if not self.average_custom:
            return 1.0
        # [denom, 1 where this rank's denom is negative or not finite], summed: every rank sees a bad one
        local = float(torch.as_tensor(denom, dtype=torch.float64).reshape(()))
        pair = torch.tensor([local, float(not (math.isfinite(local) and local >= 0))], dtype=torch.float64,
                            device=self.fp32_params.device)
        if _distributed() and self.world_size > 1:
            collective("FP16Optimizer denom all_reduce", dist.all_reduce, pair)
        total, bad = pair.tolist()
        if bad:
            raise ValueError(f"denom: must be a finite number >= 0 on every rank; {int(bad)} rank(s) gave another "
                             f"(this rank: {local})")
        if not total > 0:
            raise ValueError(f"denom: the summed denominator must be > 0, got {total}")
        return total

    def _aggregate(self, grad: Tensor, divisor: float) -> None:
        distributed = _distributed() and self.world_size > 1
        if self.divide_before:
            grad.div_(divisor)
        if distributed:
            pieces = ([grad[o:o + n] for o, n in self._slices()] if self.by_layer else [grad])
            for piece in pieces:
                collective("FP16Optimizer gradient all_reduce", dist.all_reduce, piece)
        if not self.divide_before:
            grad.div_(divisor)

    def _slices(self) -> list[tuple[int, int]]:
        out, offset = [], 0
        for p in _trained(self.fp16_model):
            out.append((offset, p.numel()))
            offset += p.numel()
        return out

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"fp32_params": self.fp32_params.detach().clone(), "loss_scaler": self.loss_scaler.state_dict(),
                "optimizer": None if self.optimizer is None else self.optimizer.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Master, scaler and optimizer state, all checked before any of them changes."""
        check_keys("state", state, {"fp32_params", "loss_scaler", "optimizer"})
        flat = state["fp32_params"]
        if not isinstance(flat, Tensor) or flat.dtype != torch.float32:
            raise TypeError(f"state['fp32_params']: expected a float32 tensor, got "
                            f"{flat.dtype if isinstance(flat, Tensor) else describe(flat)}")
        if flat.shape != self.fp32_params.shape:
            raise ValueError(f"state['fp32_params']: has shape {tuple(flat.shape)}, expected "
                             f"{tuple(self.fp32_params.shape)}")
        self.loss_scaler.check_state_dict(state["loss_scaler"], where="state['loss_scaler']")
        saved_optimizer = state["optimizer"]
        if saved_optimizer is not None:
            if self.optimizer is None:
                raise RuntimeError("load_state_dict: call set_optimizer first (the state holds optimizer state)")
            check_optimizer_state(self.optimizer, saved_optimizer, "state['optimizer']")
            self.optimizer.load_state_dict(saved_optimizer)  # its own checks may still refuse: nothing else changed yet
        self.loss_scaler.load_state_dict(state["loss_scaler"])
        self.fp32_params.copy_(flat)
        self.fp32_to_fp16_weights(self.fp16_model, self.fp32_params)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


_TRACKER_EVENTS = ("record_batch_agg", "record_batch_opt_step")


def _check_tracker(tracker: Any) -> None:
    if tracker is None:
        return
    missing = [e for e in _TRACKER_EVENTS if not callable(getattr(tracker, e, None))]
    if missing:
        raise TypeError(f"tracker: expected None or an mlbench Tracker with {' and '.join(missing)}(), got "
                        f"{describe(tracker)}")


def _record(tracker: Any, event: str) -> None:
    if tracker is not None:
        getattr(tracker, event)()


def _check_module(model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"fp16_model: expected a torch.nn.Module, got {describe(model)}")


def _check_flat(fp32_params: Any, fp16_model: Any) -> None:
    """The flat master must cover the model's trained params exactly (a frozen or added param would
    shift every slice after it)."""
    _check_module(fp16_model)
    if not isinstance(fp32_params, Tensor) or not fp32_params.is_floating_point():
        raise TypeError(f"fp32_params: expected a floating-point tensor, got "
                        f"{fp32_params.dtype if isinstance(fp32_params, Tensor) else describe(fp32_params)}")
    numel = sum(p.numel() for p in _trained(fp16_model))
    if fp32_params.dim() != 1 or fp32_params.numel() != numel:
        raise ValueError(f"fp32_params: must be 1-D with one element per trained model parameter ({numel}), got "
                         f"shape {tuple(fp32_params.shape)} (did requires_grad change after FP16Optimizer was built?)")


def _check_denom(denom: Any) -> None:
    """A real number or a one-element real tensor (mlbench passes token counts); the range (finite,
    >= 0, a positive sum) is checked after the all-reduce so that every rank raises together."""
    if isinstance(denom, Tensor):
        if denom.numel() != 1 or denom.is_complex() or denom.dtype == torch.bool:
            raise TypeError(f"denom: expected a number or a one-element real tensor, got {denom.dtype} of shape "
                            f"{tuple(denom.shape)}")
    elif is_bool(denom) or not isinstance(denom, numbers.Real):
        raise TypeError(f"denom: expected a number or a one-element real tensor, got {describe(denom)}")
