"""Turn the optimizer a LightningModule returns into its 1-bit variant (hyper-parameters only).

``to_onebit(optimizer, OnebitAdam, knobs)`` builds a new optimizer over the same param groups:

=====================================================  ==========================================
source                                                 target
=====================================================  ==========================================
``torch.optim.Adam`` / ``AdamW``,                      ``OnebitAdam``, ``ZeroOneAdam``
``lightning_optim`` ``Adam``/``AdamW``/``FusedAdam``/
``CPUAdam``
``lightning_optim`` ``Lamb`` / ``FusedLamb``           ``OnebitLamb``
=====================================================  ==========================================

Carried per group: ``lr`` (its current value), ``betas``, ``eps``, ``weight_decay``,
``bias_correction``, ``kahan_sum`` and, from LAMB, ``eps_inside_sqrt``, ``max_coeff``,
``min_coeff``; every key the source optimizer does not define (``initial_lr`` set by an LR
scheduler, user tags such as ``name``, ``exp_avg_mask``) is kept as is. The 1-bit optimizers
decay decoupled (``p <- p - lr * wd * p``, AdamW's rule; LAMB: ``wd * p`` inside the update
that the trust ratio scales), so a combination they cannot express is refused with a
``ValueError`` naming the group and the setting, never silently changed:

* Adam's coupled L2 decay (``torch.optim.Adam(weight_decay > 0)``, ``decoupled_weight_decay=False``):
  use AdamW, or ``weight_decay=0``;
* ``amsgrad``, ``maximize``, ``decouple_lr`` (``lr/max_lr`` scaled decay);
* LAMB with ``decoupled_weight_decay=False`` and decay, ``grad_averaging=False``, ``adam=True``,
  ``max_grad_norm > 0`` (clip with ``Trainer(gradient_clip_val=...)`` instead), or
  ``use_nvlamb=False`` with a group without decay (1-bit LAMB applies the trust ratio to every
  tensor, as ``use_nvlamb=True``/``FusedLamb`` do).

Implementation flags (``foreach``, ``fused``, ``capturable``, ``fp32_state``...) are dropped:
the 1-bit optimizers keep fp32 states and use their own flat buffers. Any other optimizer class
is refused with a ``TypeError`` naming it. No Lightning import here: the strategies call this.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_optim.onebit import OnebitAdam, OnebitLamb, OnebitOptimizer, ZeroOneAdam
from lightning_optim.optim.adam import Adam as _LoAdam
from lightning_optim.optim.lamb import Lamb as _LoLamb

__all__ = ["to_onebit", "accepted_sources", "retarget_schedulers"]

_ADAM_TARGETS = (OnebitAdam, ZeroOneAdam)


def accepted_sources(target: type[OnebitOptimizer]) -> str:
    """The optimizer classes a strategy for ``target`` converts, in words (for messages)."""
    if issubclass(target, OnebitLamb):
        return "lightning_optim.Lamb / FusedLamb"
    return "torch.optim.Adam / AdamW, lightning_optim.Adam / AdamW / FusedAdam / CPUAdam"


def _is_adam_source(optimizer: torch.optim.Optimizer) -> bool:
    return type(optimizer) in (torch.optim.Adam, torch.optim.AdamW) or isinstance(optimizer, _LoAdam)


def _float(value: Any) -> Any:
    return float(value) if isinstance(value, torch.Tensor) and value.numel() == 1 else value


def _refuse(source: torch.optim.Optimizer, index: int, what: str) -> ValueError:
    return ValueError(f"cannot convert {type(source).__name__} param group {index} to a 1-bit optimizer: {what}")


def _adam_group(source: torch.optim.Optimizer, index: int, group: dict[str, Any]) -> dict[str, Any]:
    for flag in ("amsgrad", "maximize", "decouple_lr"):
        if group.get(flag, False):
            raise _refuse(source, index, f"{flag}=True is not supported by the 1-bit Adam variants")
    decoupled = group.get("decoupled_weight_decay", isinstance(source, torch.optim.AdamW))
    if group["weight_decay"] and not decoupled:
        raise _refuse(
            source,
            index,
            f"weight_decay={group['weight_decay']} is coupled L2 decay (Adam); the 1-bit optimizers decay "
            "decoupled (AdamW's p <- p - lr*wd*p). Use AdamW (or decoupled_weight_decay=True), or weight_decay=0",
        )
    return {
        "lr": _float(group["lr"]),
        "betas": tuple(_float(b) for b in group["betas"]),
        "eps": group["eps"],
        "weight_decay": group["weight_decay"],
        "bias_correction": group.get("bias_correction", True),
        "eps_inside_sqrt": False,
        "kahan_sum": group.get("kahan_sum"),
    }


def _lamb_group(source: torch.optim.Optimizer, index: int, group: dict[str, Any]) -> dict[str, Any]:
    wd = group["weight_decay"]
    if group.get("maximize", False):
        raise _refuse(source, index, "maximize=True is not supported by OnebitLamb")
    if group.get("adam", False):
        raise _refuse(source, index, "adam=True (trust ratio 1) is not LAMB; OnebitLamb always uses the trust ratio")
    if not group.get("grad_averaging", True):
        raise _refuse(source, index, "grad_averaging=False; OnebitLamb's momentum always averages (1 - beta1)")
    if wd and not group.get("decoupled_weight_decay", group.get("adam_w_mode", True)):  # ours, or apex's name
        raise _refuse(source, index, f"decoupled_weight_decay=False with weight_decay={wd} (L2 on the gradient); "
                                     "OnebitLamb decays inside the update (decoupled_weight_decay=True)")
    if group.get("max_grad_norm", 0.0) > 0:
        raise _refuse(source, index, f"max_grad_norm={group['max_grad_norm']}: OnebitLamb does not clip; "
                                     "clip with Trainer(gradient_clip_val=...) and set max_grad_norm=0")
    if not wd and not group.get("use_nvlamb", False):
        raise _refuse(
            source,
            index,
            "use_nvlamb=False leaves groups without weight decay unscaled (trust ratio 1), but 1-bit LAMB "
            "applies the trust ratio to every tensor; pass use_nvlamb=True (or use FusedLamb) to accept that",
        )
    return {
        "lr": _float(group["lr"]),
        "betas": tuple(_float(b) for b in group["betas"]),
        "eps": group["eps"],
        "weight_decay": wd,
        "bias_correction": group.get("bias_correction", True),
        "eps_inside_sqrt": group.get("eps_inside_sqrt", False),
        "max_coeff": group.get("max_coeff", 10.0),
        "min_coeff": group.get("min_coeff", 0.01),
        "kahan_sum": group.get("kahan_sum"),
    }


def to_onebit(
    optimizer: torch.optim.Optimizer,
    target: type[OnebitOptimizer],
    knobs: dict[str, Any] | None = None,
    *,
    process_group: Any = None,
    average_grads: bool = False,
) -> OnebitOptimizer:
    """A ``target`` optimizer with ``optimizer``'s param groups and hyper-parameters.

    ``knobs`` are the 1-bit arguments (``freeze_step``...), passed to ``target``'s constructor.
    The source must not have stepped yet (its moments would be lost): ``ValueError`` otherwise.
    """
    if issubclass(target, _ADAM_TARGETS):
        if not _is_adam_source(optimizer):
            raise TypeError(
                f"{target.__name__} can replace {accepted_sources(target)}, not {type(optimizer).__module__}."
                f"{type(optimizer).__name__}; return one of those from configure_optimizers (or a {target.__name__})"
            )
        translate = _adam_group
    elif issubclass(target, OnebitLamb):
        if not isinstance(optimizer, _LoLamb):
            raise TypeError(
                f"OnebitLamb can replace {accepted_sources(target)}, not {type(optimizer).__module__}."
                f"{type(optimizer).__name__}; return one of those from configure_optimizers (or an OnebitLamb)"
            )
        translate = _lamb_group
    else:  # pragma: no cover - the strategies only pass the three classes
        raise TypeError(f"unknown 1-bit optimizer class {target!r}")
    if any(state for state in optimizer.state.values()):
        raise ValueError(
            f"{type(optimizer).__name__} has already stepped (it holds state); convert it before training, "
            f"or construct a {target.__name__} yourself"
        )
    source_keys = set(optimizer.defaults) | {"params"}
    groups = []
    for index, group in enumerate(optimizer.param_groups):
        carried = {k: v for k, v in group.items() if k not in source_keys}  # initial_lr, user tags, masks
        groups.append({"params": list(group["params"]), **carried, **translate(optimizer, index, group)})
    # Every group carries its own values; the defaults (for groups added later) follow the first one.
    defaults = translate(optimizer, 0, optimizer.param_groups[0])
    return target(groups, **defaults, **(knobs or {}), process_group=process_group, average_grads=average_grads)


def _track_step_called(optimizer: torch.optim.Optimizer) -> None:
    """What torch's LRScheduler does to an optimizer: mark ``_opt_called`` on every ``step()``
    (its check that ``optimizer.step()`` runs before ``scheduler.step()``)."""
    step = optimizer.step
    if getattr(step, "_wrapped_by_lr_sched", False):
        return
    func = step.__func__  # type: ignore[attr-defined]  # a bound method; torch types step by its overloads

    # the marks torch's LRScheduler puts on the optimizer and on the step it wraps, on this instance only
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return func(optimizer, *args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper  # type: ignore[method-assign]


def retarget_schedulers(schedulers: list[Any], old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> int:
    """Point every scheduler (and nested one: SequentialLR, ChainedScheduler) that drives ``old``
    at ``new``; returns how many were changed. The param groups of ``new`` already carry the
    schedulers' ``initial_lr`` and current ``lr``."""
    changed = 0
    for scheduler in schedulers:
        if getattr(scheduler, "optimizer", None) is old:
            scheduler.optimizer = new
            _track_step_called(new)
            changed += 1
        nested = getattr(scheduler, "_schedulers", None)
        if nested:
            changed += retarget_schedulers(list(nested), old, new)
    return changed
