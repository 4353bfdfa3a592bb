"""Argument and state-dict checks of the precision tools (and the Accelerate adapters built on them).

Each check raises before its caller changes anything: ``TypeError`` for a value of the wrong kind,
``ValueError`` for one out of range, both naming the argument (or the state-dict key) and what is
valid. numpy scalars count as the Python numbers they hold (``np.float32(2.0)`` is a number,
``np.bool_(True)`` a flag); bools are never numbers (``True`` as a loss scale is a slip).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Set
from typing import Any

import torch
from torch import Tensor

from lightning_optim.optim.steps import check_step
from lightning_optim.optim.validation import is_bool

__all__ = ["check_bool", "check_callable", "check_count", "check_keys", "check_label", "check_number",
           "check_optimizer", "check_optimizer_state", "check_tensor_list", "clip_norm", "describe"]


def describe(value: object) -> str:
    """``type (repr)``, short enough for a message."""
    text = repr(value)
    return f"{type(value).__name__} ({text if len(text) <= 60 else text[:57] + '...'})"


def _range_text(above: float | None, at_least: float | None, below: float | None, allow_inf: bool) -> str:
    low = f"({above:g}" if above is not None else f"[{at_least:g}" if at_least is not None else "(-inf"
    high = f"{below:g})" if below is not None else "inf]" if allow_inf else "inf)"
    return f"{low}, {high}"


def check_number(name: str, value: object, *, above: float | None = None, at_least: float | None = None,
                 below: float | None = None, allow_inf: bool = False) -> float:
    """A real number (Python or numpy) in ``(above | [at_least, below | inf)``; ``allow_inf``: +inf too."""
    valid = _range_text(above, at_least, below, allow_inf)
    if is_bool(value) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: must be a real number in {valid}, got {describe(value)}")
    number = float(value)
    if math.isnan(number) or (math.isinf(number) and not (allow_inf and number > 0)):
        raise ValueError(f"{name}: must be in {valid}, got {number}")
    too_low = (above is not None and not number > above) or (at_least is not None and number < at_least)
    if too_low or (below is not None and not number < below):
        raise ValueError(f"{name}: must be in {valid}, got {number:g}")
    return number


def check_count(name: str, value: object, *, minimum: int = 0, maximum: int | None = None) -> int:
    """A whole number (Python or numpy int; not a float, not a bool) in ``[minimum, maximum]``."""
    valid = f"[{minimum}, {'inf)' if maximum is None else f'{maximum}]'}"
    if is_bool(value) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: must be an int in {valid}, got {describe(value)}")
    count = int(value)
    if count < minimum or (maximum is not None and count > maximum):
        raise ValueError(f"{name}: must be in {valid}, got {value}")
    return count


def check_bool(name: str, value: object) -> bool:
    """True or False (numpy's too); a string such as ``"false"`` from a config is refused."""
    if not is_bool(value):
        raise TypeError(f"{name}: must be True or False, got {describe(value)}")
    return bool(value)


def clip_norm(name: str, value: object) -> float | None:
    """A clipping threshold: None or inf (no clipping) or a number in (0, inf). 0 would zero every
    gradient and a negative one flip them (torch's ``clip_grad_norm_`` checks neither)."""
    if value is None:
        return None
    number = check_number(name, value, above=0.0, allow_inf=True)
    return None if math.isinf(number) else number


def check_optimizer(name: str, value: object) -> torch.optim.Optimizer:
    if not isinstance(value, torch.optim.Optimizer):
        raise TypeError(f"{name}: expected a torch.optim.Optimizer, got {describe(value)}")
    return value


def check_tensor_list(name: str, values: object, *, floating: bool = True) -> list[Tensor]:
    """An iterable of tensors. A bare tensor is refused as torch.optim refuses it: iterating it would
    silently give its rows."""
    if isinstance(values, Tensor):
        raise TypeError(f"{name}: expected an iterable of Tensors, got a single Tensor of shape {tuple(values.shape)}; "
                        "wrap it in a list")
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
        raise TypeError(f"{name}: expected an iterable of Tensors, got {describe(values)}")
    out = list(values)
    for i, t in enumerate(out):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}[{i}]: expected a Tensor, got {describe(t)}")
        if floating and not t.is_floating_point():
            raise TypeError(f"{name}[{i}]: expected a floating-point tensor, got {t.dtype}")
    return out


def check_keys(where: str, state: object, required: Set[Any], optional: Set[Any] = frozenset()) -> Mapping:
    """``state`` is a mapping holding every ``required`` key and nothing beyond ``optional``."""
    if not isinstance(state, Mapping):
        raise TypeError(f"{where}: expected a dict (a state_dict()), got {describe(state)}")
    missing, extra = required - set(state), set(state) - required - optional
    if missing or extra:
        raise ValueError(f"{where}: expected the keys {sorted(required)}"
                         f"{f' (optional: {sorted(optional)})' if optional else ''}; missing: {sorted(missing)}, "
                         f"extra: {sorted(map(str, extra))}")
    return state




def check_optimizer_state(optimizer: torch.optim.Optimizer, state: object, where: str) -> None:
    """The checks a state dict of ``optimizer`` must pass before any optimizer loads it.

    torch's ``Optimizer.load_state_dict`` casts every state tensor to the param's dtype (an int64
    moment becomes a float silently) and checks no shape: per-param tensors (other than 0-d scalars)
    must be floating point with the param's shape, steps whole numbers >= 0, and the groups must hold
    as many params as the optimizer's.
    """
    if not isinstance(state, Mapping):
        raise TypeError(f"{where}: expected an optimizer state_dict() (a dict), got {describe(state)}")
    missing = {"state", "param_groups"} - set(state)  # other keys are the optimizer's own (1-bit: "onebit")
    if missing:
        raise ValueError(f"{where}: an optimizer state_dict() holds 'state' and 'param_groups'; missing: "
                         f"{sorted(missing)}")
    groups, per_param = state["param_groups"], state["state"]
    if not isinstance(groups, (list, tuple)) or len(groups) != len(optimizer.param_groups):
        raise ValueError(f"{where}['param_groups']: expected {len(optimizer.param_groups)} groups, got "
                         f"{len(groups) if isinstance(groups, (list, tuple)) else describe(groups)}")
    if not isinstance(per_param, Mapping):
        raise TypeError(f"{where}['state']: expected a dict, got {describe(per_param)}")
    ids = []
    for gi, (group, saved) in enumerate(zip(optimizer.param_groups, groups)):
        saved_params = saved.get("params") if isinstance(saved, Mapping) else None
        if not isinstance(saved_params, (list, tuple)) or len(saved_params) != len(group["params"]):
            raise ValueError(f"{where}['param_groups'][{gi}]: expected a 'params' list of {len(group['params'])} "
                             f"ids, got {describe(saved_params)}")
        ids += list(zip(saved_params, group["params"]))
    known = {pid for pid, _ in ids}
    unknown = [k for k in per_param if k not in known]
    if unknown:
        raise ValueError(f"{where}['state']: holds state for param ids {unknown[:5]} that no group lists")
    for pid, p in ids:
        entry = per_param.get(pid)
        if entry is None:
            continue
        if not isinstance(entry, Mapping):
            raise TypeError(f"{where}['state'][{pid!r}]: expected a dict, got {describe(entry)}")
        for key, value in entry.items():
            name = f"{where}['state'][{pid!r}][{key!r}]"
            if key == "step":  # torch keeps it as a float tensor, older checkpoints as an int
                check_step(value, name)
            elif isinstance(value, Tensor) and value.dim() > 0:
                kind_ok = value.is_complex() if p.is_complex() else value.is_floating_point()
                if not kind_ok:
                    raise TypeError(f"{name}: expected a floating-point tensor like its param ({p.dtype}), got "
                                    f"{value.dtype}")
                if value.shape != p.shape:
                    raise ValueError(f"{name}: has shape {tuple(value.shape)}, its param {tuple(p.shape)}")


def check_label(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected a str (the name used in messages), got {describe(value)}")
    return value


def check_callable(name: str, value: Any) -> Any:
    if value is not None and not callable(value):
        raise TypeError(f"{name}: expected None or a callable, got {describe(value)}")
    return value
