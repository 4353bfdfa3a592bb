r"""mlbench-core's centralized (synchronous, all-reduce) optimizers, with mlbench's classes and
constructor arguments, on any torch.distributed backend.

Every rank :math:`r` of :math:`W` holds the same model and a local optimizer :math:`U` (SGD, Adam,
or any ``torch.optim.Optimizer``). With the local gradients :math:`g_r` and a divisor :math:`D`
(:math:`W` for ``average_world``, the step's ``denom`` for ``average_custom``, none for a sum):

.. math::
    \text{agg\_grad=True:}\quad & \bar g = \tfrac1D \textstyle\sum_r g_r
        \;(\text{or } \sum_r g_r / D \text{ with divide\_before}),\quad
        \bar g \leftarrow \bar g \min\!\big(1, \tfrac{c}{\lVert \bar g\rVert_2 + 10^{-6}}\big),\quad
        p \leftarrow U(p, \bar g) \text{ on every rank} \\
    \text{agg\_grad=False:}\quad & p_r \leftarrow U(p_r, g_r),\quad p \leftarrow \tfrac1W \textstyle\sum_r p_r

(clip :math:`c` = ``grad_clip``, torch's ``clip_grad_norm_``, after the aggregation; the weights are
also averaged once at construction with ``agg_grad=False``, as mlbench does.) The aggregation:
:mod:`lightning_optim.distributed.aggregation` (flat or ``by_layer``, fp32 sums for bf16/fp16).

Each class is a ``torch.optim.Optimizer`` whose ``param_groups``/``state`` are the local
optimizer's (``self.optimizer``), so LR schedulers, ``state_dict``/``load_state_dict`` and
``zero_grad`` act on it. The model must be the plain module: a DDP-wrapped one is refused (DDP
would all-reduce the gradients a second time, in backward).

Deviations from mlbench (each because mlbench's behaviour is a bug or a trap):

* ``world_size=None`` is the default group's size; a different number is refused (mlbench trusts it).
* A closure runs *before* the aggregation (mlbench hands it to the local step, after the
  aggregation, so the gradients it computes are never aggregated). ``step`` returns its loss
  (mlbench's ``CustomCentralizedOptimizer.step`` returns ``True``).
* ``use_cuda`` is checked and not acted on: the tensors stay on the params' device (``use_cuda=True`` with
  params off CUDA warns).
* Params without a gradient: see ``aggregation`` (mlbench crashes on them).
* The weights are averaged in place (mlbench swaps ``param.data`` for views of its packed buffer).
* ``CustomCentralizedOptimizer``: neither ``average_world`` nor ``average_custom`` sums the
  gradients (mlbench raises ``NotImplementedError``); ``average_custom`` divides by ``denom`` with one
  rank too (mlbench skips the whole aggregation then, division included); with ``agg_grad=False``
  only ``average_world`` and no ``grad_clip`` are accepted (mlbench fails at the first step with
  ``average_custom``, and silently ignores ``grad_clip``: there is no aggregated gradient to clip).
* ``GenericCentralizedOptimizer`` takes its local optimizer as ``optimizer=`` (mlbench's has none
  and cannot step); ``add_param_group`` is refused (the ranks agreed on the params at construction).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from lightning_optim.comm.agreement import layout_signature
from lightning_optim.distributed.aggregation import AllReduceAggregation
from lightning_optim.distributed.agreement import (
    AVERAGES,
    SETUP_FIELDS,
    bits_float,
    check_denom,
    check_module,
    check_required_lr,
    check_step_inputs,
    check_then_agree,
    check_world_size,
    float_bits,
    model_params,
    required,
    show_setup,
    warn_use_cuda,
)
from lightning_optim.distributed.loading import check_local_state_dict
from lightning_optim.optim.adam import Adam
from lightning_optim.optim.hooks import init_wrapper_hooks, load_with_hooks, state_dict_with_hooks
from lightning_optim.optim.sgd import SGD
from lightning_optim.optim.validation import check_flag, check_positive

__all__ = ["GenericCentralizedOptimizer", "CentralizedSGD", "CentralizedAdam", "CustomCentralizedOptimizer"]

class GenericCentralizedOptimizer(torch.optim.Optimizer):
    r"""Aggregates the gradients before the local step (``agg_grad=True``) or the weights after it,
    averaged over the world size (see the module docstring for the equations).

    Args:
        world_size: ranks in the default group (None: its size; another number is refused).
        model: the ``nn.Module`` whose params the local optimizer holds.
        use_cuda: accepted for mlbench compatibility; the params' device is used (True off CUDA warns).
        by_layer: one collective per param instead of one flat buffer.
        divide_before: divide by the world size before the sum (smaller partial sums).
        agg_grad: aggregate the gradients (True) or the weights after the local step (False).
        optimizer: the local optimizer over ``model``'s params (keyword; the subclasses build theirs).
    """

    def __init__(self, world_size: int | None, model: torch.nn.Module, use_cuda: bool = False,
                 by_layer: bool = False, divide_before: bool = False, agg_grad: bool = True, *,
                 optimizer: torch.optim.Optimizer | None = None) -> None:
        def build() -> torch.optim.Optimizer:
            if optimizer is None:
                raise TypeError("optimizer: GenericCentralizedOptimizer needs the local optimizer (optimizer=...); "
                                "or use CentralizedSGD, CentralizedAdam or CustomCentralizedOptimizer")
            return optimizer

        self._setup(world_size, model, build, use_cuda=use_cuda, by_layer=by_layer, divide_before=divide_before,
                    agg_grad=agg_grad)

    def _setup(self, world_size: object, model: object, build: Callable[[], torch.optim.Optimizer], *,
               use_cuda: bool, by_layer: bool, divide_before: bool, agg_grad: bool,
               grad_clip: float = math.inf, average: str = "world",
               checks: Callable[[], None] | None = None) -> None:
        """Check everything on this rank, agree across ranks, and only then take the settings."""
        who = type(self).__name__

        def local() -> tuple[Any, tuple[int, ...]]:
            for name, flag in (("use_cuda", use_cuda), ("by_layer", by_layer), ("divide_before", divide_before),
                               ("agg_grad", agg_grad)):
                check_flag(name, flag)
            world = check_world_size(world_size)
            if checks is not None:
                checks()
            check_module(model)
            optimizer = build()
            if isinstance(optimizer, GenericCentralizedOptimizer):
                raise TypeError("optimizer must be a local optimizer, not a centralized one (its aggregation "
                                "would run twice); give the optimizer it wraps")
            params = model_params(model, optimizer)
            row = (*layout_signature(params), by_layer, divide_before, agg_grad, AVERAGES.index(average),
                   float_bits(float(grad_clip)))  # checks() made sure it is a number
            return (world, optimizer, params), row

        world, optimizer, params = check_then_agree(who, local, SETUP_FIELDS, show=show_setup)
        warn_use_cuda(who, use_cuda, params)
        # from here on every argument passed on every rank: take them
        init_wrapper_hooks(self)  # torch's step hooks and profiler label, as Optimizer.__init__ does
        self.optimizer = optimizer
        self.model = model
        self.world_size = world
        self.agg_grad = agg_grad
        self.by_layer = by_layer
        self.divide_before = divide_before
        self.grad_clip = float(grad_clip)
        self._average = average
        self._aggregation = AllReduceAggregation(params, world, by_layer=by_layer, divide_before=divide_before)
        if not agg_grad:
            self._aggregation.weights(float(world))  # mlbench: every rank starts from the averaged model

    # ------------------------------------------------------------------ torch.optim.Optimizer face
    # read-only views of the local optimizer's, where torch.optim.Optimizer declares plain attributes
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The local optimizer's groups (live: LR schedulers set ``lr`` here, also after a reload)."""
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The local optimizer's state dict. With ``agg_grad=False`` its state (e.g. momentum) is
        this rank's own: save one per rank. With ``agg_grad=True`` it is the same on every rank.
        State-dict hooks registered on this optimizer run around it (the local one's run inside)."""
        return state_dict_with_hooks(self, self.optimizer.state_dict)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The local optimizer's ``load_state_dict``, after the checks torch's own skips (a foreign local
        optimizer: state dtypes and shapes, group hyper-parameters; see ``loading.py``): nothing changes
        when it refuses. Load hooks registered on this optimizer run around it, as torch runs them."""
        load_with_hooks(self, state_dict, self._load_checked)

    def _load_checked(self, state_dict: dict[str, Any]) -> None:
        check_local_state_dict(self.optimizer, state_dict)
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise RuntimeError(f"{type(self).__name__}: the aggregated params are fixed at construction (every rank "
                           "agreed on them); build a new optimizer over the new params instead")

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(world_size={self.world_size}, by_layer={self.by_layer}, "
                f"divide_before={self.divide_before}, agg_grad={self.agg_grad}, optimizer={self.optimizer!r})")

    # ------------------------------------------------------------------ stepping
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, tracker: Any = None) -> Any:
        """Evaluate ``closure`` (if any), aggregate, and run the local step; returns the closure's
        loss. ``tracker``: an mlbench Tracker, told of the aggregation and of the local step."""
        return self._step(closure, tracker, None)

    def _step(self, closure: Callable[[], Any] | None, tracker: Any, denom: object) -> Any:
        check_step_inputs(closure, tracker)
        if getattr(self.optimizer, "gradient_release", False):
            raise RuntimeError("optimizer: its gradient release stepped inside backward, before any aggregation; "
                               "undo prepare_for_gradient_release to use it in a centralized optimizer")
        divisor = self._divisor(denom)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.agg_grad:
            if self._aggregation.grads(divisor) and tracker is not None:
                tracker.record_batch_agg()
            if self.grad_clip != math.inf:  # the aggregate is the same on every rank: so is the clip
                with_grads = [p for p in self._aggregation.params if p.grad is not None]
                torch.nn.utils.clip_grad_norm_(with_grads, self.grad_clip)
            self.optimizer.step()
            if tracker is not None:
                tracker.record_batch_opt_step()
        else:
            self.optimizer.step()
            if tracker is not None:
                tracker.record_batch_opt_step()
            if self._aggregation.weights(divisor) and tracker is not None:
                tracker.record_batch_agg()
        return loss

    def _divisor(self, denom: object) -> float | None:
        """What the summed tensors are divided by this step (None: nothing)."""
        if self._average != "custom":
            if denom is not None:
                raise ValueError("denom: only used with average_custom=True (this optimizer divides by "
                                 f"{'the world size' if self._average == 'world' else 'nothing: it sums'})")
            return float(self.world_size) if self._average == "world" else None

        def local() -> tuple[float, tuple[int]]:
            if denom is None:
                raise ValueError("denom: average_custom=True divides the aggregated gradients by step(denom=...); "
                                 "give it on every rank (e.g. the global number of tokens)")
            value = check_denom(denom)
            return value, (float_bits(value),)

        # a per-step input that must match: one small bounded all_gather (mlbench uses it as given)
        return check_then_agree(f"{type(self).__name__}.step", local, ("denom",),
                                show=lambda _, bits: repr(bits_float(bits)))


class CentralizedSGD(GenericCentralizedOptimizer):
    r"""Centralized SGD: the gradients (or, with ``agg_grad=False``, the weights) are averaged over
    the ranks and the local step is :class:`lightning_optim.SGD` (torch's SGD: momentum
    :math:`b \leftarrow \mu b + (1-\tau) d`, :math:`d = g + \lambda p`, Nesterov optional).
    ``world_size``, ``model``, ``use_cuda``, ``by_layer``, ``agg_grad``: see
    :class:`GenericCentralizedOptimizer`; the rest are SGD's.
    """

    def __init__(self, world_size: int | None = None, model: torch.nn.Module | None = None, lr: float = required,
                 momentum: float = 0, dampening: float = 0, weight_decay: float = 0, nesterov: bool = False,
                 use_cuda: bool = False, by_layer: bool = False, agg_grad: bool = True) -> None:
        def build() -> torch.optim.Optimizer:
            check_required_lr(lr)
            return SGD(check_module(model).parameters(), lr=lr, momentum=momentum, dampening=dampening,
                       weight_decay=weight_decay, nesterov=nesterov)

        self._setup(world_size, model, build, use_cuda=use_cuda, by_layer=by_layer, divide_before=False,
                    agg_grad=agg_grad)


class CentralizedAdam(GenericCentralizedOptimizer):
    r"""Centralized Adam: averaged gradients (or weights, ``agg_grad=False``) with
    :class:`lightning_optim.Adam` as the local step (:math:`m \leftarrow \beta_1 m + (1-\beta_1)\bar g`,
    :math:`v \leftarrow \beta_2 v + (1-\beta_2)\bar g^2`, :math:`p \leftarrow p - \eta \hat m/(\sqrt{\hat v}+\epsilon)`;
    AMSGrad optional, ``weight_decay`` as L2). Other arguments: see :class:`GenericCentralizedOptimizer`.
    """

    def __init__(self, world_size: int | None = None, model: torch.nn.Module | None = None, lr: float = required,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-08, weight_decay: float = 0,
                 amsgrad: bool = False, use_cuda: bool = False, by_layer: bool = False, agg_grad: bool = True) -> None:
        def build() -> torch.optim.Optimizer:
            check_required_lr(lr)
            return Adam(check_module(model).parameters(), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        amsgrad=amsgrad)

        self._setup(world_size, model, build, use_cuda=use_cuda, by_layer=by_layer, divide_before=False,
                    agg_grad=agg_grad)


class CustomCentralizedOptimizer(GenericCentralizedOptimizer):
    r"""Any local ``optimizer`` (over ``model``'s params) with a choice of divisor and clipping:

    * ``average_world``: :math:`\bar g = \sum_r g_r / W`;
    * ``average_custom``: :math:`\bar g = \sum_r g_r / D` with ``D = step(denom=...)`` (a number or a
      one-element tensor), used as given, as mlbench does: pass the *global* count (e.g. tokens over
      all ranks); every rank must pass the same value (checked each step by one small bounded
      all_gather, so a forgotten or rank-local ``denom`` raises on every rank);
    * neither: :math:`\bar g = \sum_r g_r`.

    ``grad_clip`` (in (0, inf]) clips the aggregated gradients to that L2 norm before the local step.
    ``agg_grad=False`` averages the weights after the local step (only with ``average_world``).
    """

    def __init__(self, model: torch.nn.Module, world_size: int | None, optimizer: torch.optim.Optimizer,
                 use_cuda: bool = False, by_layer: bool = False, agg_grad: bool = True,
                 grad_clip: float = float("inf"), average_world: bool = False, average_custom: bool = False,
                 divide_before: bool = False) -> None:
        def checks() -> None:
            check_positive("grad_clip", grad_clip, allow_inf=True)
            check_flag("average_world", average_world)
            check_flag("average_custom", average_custom)
            if average_world and average_custom:
                raise ValueError("average_world and average_custom: choose at most one (neither sums the gradients)")
            if not agg_grad and not average_world:
                raise ValueError("average_world must be True with agg_grad=False: the weights are averaged after the "
                                 "local step (a sum of the ranks' weights, or one divided by a per-step denom, is "
                                 "not a model)")
            if not agg_grad and grad_clip != math.inf:
                raise ValueError("grad_clip must be inf with agg_grad=False: it clips the aggregated gradients, which "
                                 "agg_grad=False never forms (clip the local ones yourself before step)")

        average = "world" if average_world else "custom" if average_custom else "sum"
        self._setup(world_size, model, lambda: optimizer, use_cuda=use_cuda, by_layer=by_layer,
                    divide_before=divide_before, agg_grad=agg_grad,
                    grad_clip=grad_clip, average=average, checks=checks)
        self.average_world = average_world
        self.average_custom = average_custom

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, tracker: Any = None, denom: object = None) -> Any:
        """As :meth:`GenericCentralizedOptimizer.step`; ``denom``: the divisor of ``average_custom``."""
        return self._step(closure, tracker, denom)
