"""Check the main job's config before anything trains or validates, and name the Hydra key at fault.

The optimizer is built lazily by Lightning (in ``configure_optimizers``, after the first validation
pass), so a bad ``optimizer.lr`` used to surface deep in a traceback, as ``lr``. Here each group is
built once up front, on a dummy parameter: the optimizer partial, the strategy (and the 1-bit
conversion it will do), and the scheduler's numbers against ``trainer.max_steps``. A failure becomes
a :class:`ConfigError` whose message starts with the full key (``optimizer.lr: ...``); the job
prints it in a few lines and exits with status 2.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import hydra
import torch

from lightning_optim.onebit import OnebitOptimizer

__all__ = ["ConfigError", "check_config"]

_HYDRA_KEYS = ("_target_", "_partial_", "_recursive_", "_convert_", "_args_")


class ConfigError(ValueError):
    """A config value is wrong; the message starts with its Hydra key."""


def _culprit(group: str, options: dict[str, Any], build: Callable[[dict[str, Any]], Any], exc: Exception) -> str:
    """The key of ``options`` that ``exc`` is about: named in the message, else the one whose removal
    (back to the class default) makes ``build`` succeed; else the group itself."""
    keys = [k for k in options if k not in _HYDRA_KEYS]
    text = str(exc)
    named = [(m.start(), k) for k in keys for m in [re.search(rf"(?<![\w.]){re.escape(k)}(?![\w])", text)] if m]
    if named:
        return f"{group}.{min(named)[1]}"
    for key in keys:
        try:
            build({k: v for k, v in options.items() if k != key})
        except Exception:  # noqa: BLE001 - still failing: not this key
            continue
        return f"{group}.{key}"
    return group


def _check(group: str, options: dict[str, Any], build: Callable[[dict[str, Any]], Any]) -> Any:
    try:
        return build(options)
    except Exception as exc:  # hydra wraps constructor errors in InstantiationException, cause attached
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        if isinstance(cause, (TypeError, ValueError)):
            raise ConfigError(f"{_culprit(group, options, build, cause)}: {cause}") from None
        raise


def _optimizer(options: dict[str, Any]) -> torch.optim.Optimizer:
    factory = hydra.utils.instantiate(options)
    return factory([torch.zeros(4, 3, requires_grad=True), torch.zeros(3, requires_grad=True)])


def _check_release(cfg: dict[str, Any], strategy_cfg: dict[str, Any], precision_cfg: dict[str, Any]) -> None:
    """``gradient_release``: a bool, and none of the settings GradientRelease refuses at fit start."""
    release = cfg.get("gradient_release", False)
    if not isinstance(release, bool):
        raise ConfigError(f"gradient_release: must be true or false, got {release!r}")
    if not release:
        return
    clip = cfg.get("trainer", {}).get("gradient_clip_val")
    if clip:
        raise ConfigError(f"gradient_release: conflicts with trainer.gradient_clip_val={clip} (each gradient is "
                          "stepped and freed during backward); add trainer.gradient_clip_val=null")
    if precision_cfg.get("name") == "16-mixed" or "MasterWeightsPrecision" in str(precision_cfg.get("_target_")):
        raise ConfigError("gradient_release: conflicts with precision (loss scaling checks the whole model before "
                          "stepping); use precision=32-true, bf16-mixed or bf16_kahan")
    if "Onebit" in str(strategy_cfg.get("_target_")) or "ZeroOne" in str(strategy_cfg.get("_target_")):
        raise ConfigError("gradient_release: conflicts with the 1-bit strategy (it communicates the whole model's "
                          "momentum in one step); use strategy=ddp or strategy=auto")


def check_config(cfg: dict[str, Any]) -> None:
    """Raise :class:`ConfigError` for the first bad value of the optimizer, strategy or scheduler."""
    optimizer = _check("optimizer", cfg["optimizer"], _optimizer)
    strategy_cfg = cfg.get("strategy") or {}
    if "_target_" in strategy_cfg:
        strategy = _check("strategy", strategy_cfg, hydra.utils.instantiate)
        target = getattr(strategy, "optimizer_class", None)
        if target is not None and not isinstance(optimizer, OnebitOptimizer):  # the strategy will convert it
            from lightning_optim.lightning.convert import to_onebit

            try:
                to_onebit(optimizer, target, getattr(strategy, "_knobs", {}))
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"optimizer (converted by strategy={strategy_cfg['_target_']}): {exc}") from None
    precision_cfg = cfg.get("precision") or {}
    if "_target_" in precision_cfg:
        _check("precision", precision_cfg, hydra.utils.instantiate)
    _check_release(cfg, strategy_cfg, precision_cfg)
    scheduler = cfg.get("scheduler")
    if scheduler:
        for key, low, high in (("warmup_steps", 0, None), ("min_lr_ratio", 0.0, 1.0)):
            value = scheduler.get(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
                raise ConfigError(f"scheduler.{key}: must be a number, got {value!r}")
            if value < low or (high is not None and value > high):
                bounds = f"[{low}, {high}]" if high is not None else f">= {low}"
                raise ConfigError(f"scheduler.{key}: must be {bounds}, got {value}")
        max_steps = cfg.get("trainer", {}).get("max_steps", -1)
        if not isinstance(max_steps, int) or max_steps < 1:
            raise ConfigError(
                f"trainer.max_steps: the scheduler decays over trainer.max_steps, which must be >= 1 here (got "
                f"{max_steps!r}); set scheduler=null to train without it"
            )
