"""Checks a state dict must pass before torch's ``Optimizer.load_state_dict`` takes it, for the optimizers
here that load with torch's method: ``PowerSGD`` (a ``torch.optim.SGD``) and the torch optimizers the
centralized classes wrap (``GenericCentralizedOptimizer(optimizer=torch.optim.Adam(...))``).

torch checks only the number of groups and params: an int64 or complex moment is cast to the param dtype
(or fails at the next step), a wrong-shape one fails at the next step, and ``lr='x'`` is taken as given.
So, before anything changes:

* every per-param state tensor (``step`` aside) must be real floating-point and of the shape the optimizer
  makes for that key: for a torch.optim class, what one step of the same class and hyper-parameters makes on
  a small param of the same rank (the param's shape, 0-d for a scalar such as NAdam's ``mu_product``, or a
  shape that broadcasts to the param for Adafactor's factored moments), so a moment that only broadcasts
  (``exp_avg = torch.zeros(())``) is refused; for other classes, and for keys that step does not make,
  0-d, the param's shape, the shape already held, or one that broadcasts to the param;
* every group hyper-parameter must keep its kind (a flag stays a bool, a number a real number that is
  not NaN), and a torch.optim optimizer's own constructor must accept the loaded values (it checks the
  lr, betas, eps ... ranges); the key it refuses is named.

Our own optimizers (``BaseOptimizer``) check everything in their own ``load_state_dict``.
"""
from __future__ import annotations

import inspect
import math
import numbers
import warnings
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
from torch import Tensor

from lightning_optim.optim.base import BaseOptimizer
from lightning_optim.optim.state_dicts import check_state_tensor, step_count
from lightning_optim.optim.validation import check_flag, check_optional_flag

__all__ = ["check_local_state_dict", "check_param_states", "saved_groups"]

_OPTIONAL_FLAGS = ("foreach", "fused")  # torch's implementation switches: None (decide), True or False
ShapesFor = Callable[[Tensor, str, Tensor], list[tuple[int, ...]]]


def saved_groups(optimizer: torch.optim.Optimizer, state_dict: object) -> Iterator[tuple[int, dict, dict]]:
    """``(index, live group, saved group)`` once the structure matches (the checks torch makes too)."""
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError("state_dict: expected a dict with 'state' and 'param_groups'")
    saved = state_dict["param_groups"]
    if len(saved) != len(optimizer.param_groups):
        raise ValueError(f"state_dict: {len(saved)} param groups saved, the optimizer has "
                         f"{len(optimizer.param_groups)}")
    for gi, (group, old) in enumerate(zip(optimizer.param_groups, saved)):
        if not isinstance(old, dict) or len(old.get("params", ())) != len(group["params"]):
            raise ValueError(f"state_dict: param group {gi} does not hold the optimizer's "
                             f"{len(group['params'])} params")
    yield from ((gi, group, old) for gi, (group, old) in enumerate(zip(optimizer.param_groups, saved)))


def check_param_states(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any], shapes_for: ShapesFor,
                       keys: set[str] | None = None) -> None:
    """Every saved per-param state tensor against ``shapes_for(param, key, value)``; ``keys``: the only
    state keys allowed (None: any)."""
    for gi, group, saved in saved_groups(optimizer, state_dict):
        for p, pid in zip(group["params"], saved["params"]):
            entry = state_dict["state"].get(pid) or {}
            where = f"param {pid} (group {gi})"
            extra = set(entry) - keys if keys is not None else set()
            if extra and keys is not None:
                raise ValueError(f"state_dict: {where} holds state {sorted(extra)}, which "
                                 f"{type(optimizer).__name__} does not keep (only {sorted(keys)})")
            for key, value in entry.items():
                if key == "step":  # torch's counter: a whole number (a 0-d tensor of one)
                    step_count(value, where)
                elif isinstance(value, Tensor) or (keys is not None and value is not None):
                    # None: an SGD buffer not made yet; other values: a foreign optimizer's own (LBFGS's lists)
                    check_state_tensor(where, key, value, shapes_for(p, key, value), tuple(p.shape))


_LIKE, _SCALAR = "like the param", "0-d"  # else a factored moment: per dim, the param's size (True) or 1 (False)
_IMPLEMENTATION_KEYS = ("foreach", "fused", "capturable", "differentiable")  # the probe runs the default code


def _constructor_values(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> dict[str, Any] | None:
    """The group's values the class's constructor takes (None: not a torch.optim class, nothing to replay)."""
    cls = type(optimizer)
    if not cls.__module__.startswith("torch.optim") or not group["params"]:
        return None
    accepted = set(inspect.signature(cls).parameters) - {"params"}
    return {k: v for k, v in group.items() if k in accepted}


def _made_kinds(optimizer: torch.optim.Optimizer, group: dict[str, Any], p: Tensor) -> dict[str, Any]:
    """Per state key, the shape one step of ``optimizer``'s class (its group's hyper-parameters) makes for a
    param of ``p``'s rank and dtype: like the param, 0-d, a factored one (per dim: the param's size or 1), or
    None (another shape); {} when the class cannot be replayed on its own."""
    values = _constructor_values(optimizer, group)
    if values is None:
        return {}
    shape = tuple(range(2, 2 + p.dim()))  # distinct sizes: a factored moment cannot pass for the param's shape
    probe = torch.zeros(shape, dtype=p.dtype, requires_grad=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            replay = type(optimizer)([probe], **{k: v for k, v in values.items() if k not in _IMPLEMENTATION_KEYS})
            probe.grad = torch.full_like(probe, 0.5)
            # a closure for those that need one (LBFGS); torch types closures as returning a float, not a loss tensor
            replay.step(lambda: probe.sum())  # type: ignore[arg-type,return-value]
    except Exception:  # noqa: BLE001 - a class that cannot step alone here: the general rule applies
        return {}
    kinds: dict[str, Any] = {}
    for key, made in replay.state.get(probe, {}).items():
        if not isinstance(made, Tensor) or key == "step":
            continue
        if tuple(made.shape) == shape:
            kinds[key] = _LIKE
        elif made.dim() == 0:
            kinds[key] = _SCALAR
        elif made.dim() == len(shape) and all(m in (1, n) for m, n in zip(made.shape, shape)):
            kinds[key] = tuple(m == n for m, n in zip(made.shape, shape))
        else:
            kinds[key] = None
    return kinds


def _foreign_shapes(optimizer: torch.optim.Optimizer) -> ShapesFor:
    kinds: dict[tuple[int, int, torch.dtype], dict[str, Any]] = {}
    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}

    def shapes(p: Tensor, key: str, value: Tensor) -> list[tuple[int, ...]]:
        group = group_of[id(p)]
        where = (id(group), p.dim(), p.dtype)
        if where not in kinds:
            kinds[where] = _made_kinds(optimizer, group, p)
        kind = kinds[where].get(key)
        if kind == _LIKE:
            return [tuple(p.shape)]
        if kind == _SCALAR:
            return [()]
        if isinstance(kind, tuple):
            return [tuple(n if full else 1 for n, full in zip(p.shape, kind))]
        allowed = [(), tuple(p.shape)]
        live = optimizer.state.get(p, {}).get(key)
        if isinstance(live, Tensor):
            allowed.append(tuple(live.shape))
        try:  # a factored moment (Adafactor's row/column variances) broadcasts to the param
            if torch.broadcast_shapes(value.shape, p.shape) == p.shape:
                allowed.append(tuple(value.shape))
        except RuntimeError:
            pass
        return allowed

    return shapes


def _same_kind(key: str, current: object, value: object) -> None:
    """A loaded hyper-parameter keeps the kind of the live one (the range is the constructor's business)."""
    if key in _OPTIONAL_FLAGS:
        check_optional_flag(key, value)
    elif isinstance(current, bool):
        check_flag(key, value)
    elif isinstance(current, numbers.Real) and not isinstance(value, Tensor) and (
        isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value)
    ):
        raise TypeError(f"{key} must be a real number like the optimizer's {current!r}, got {value!r}")


def _replays(cls: type, p: Tensor, values: dict[str, Any]) -> BaseException | None:
    """The error ``cls``'s constructor raises for ``values`` (None: it accepts them)."""
    try:
        cls([torch.empty_like(p)], **values)
    except Exception as exc:  # noqa: BLE001 - any refusal of the constructor is a refusal of the values
        return exc
    return None


def _differs(a: object, b: object) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):  # a tensor lr: no truth value for ``!=``
        return not (isinstance(a, Tensor) and isinstance(b, Tensor) and torch.equal(a, b))
    return a is not b and a != b


def _check_by_constructor(optimizer: torch.optim.Optimizer, group: dict, saved: dict, gi: int) -> None:
    """Replay a torch.optim constructor with the loaded values (only torch's: others may communicate)."""
    cls = type(optimizer)
    current = _constructor_values(optimizer, group)
    if current is None:
        return
    p = group["params"][0]
    if _replays(cls, p, current) is not None:
        return  # not rebuildable from its group alone: nothing to compare with
    loaded = {k: v for k, v in saved.items() if k in current}
    if _replays(cls, p, {**current, **loaded}) is None:
        return
    changed = [k for k in loaded if _differs(loaded[k], current[k])]
    for key in changed:  # name the first value the constructor refuses on its own
        error = _replays(cls, p, {**current, key: loaded[key]})
        if error is not None:
            raise ValueError(f"state_dict: param group {gi}: {key}={loaded[key]!r} is refused by "
                             f"{cls.__name__}: {error}")
    raise ValueError(f"state_dict: param group {gi}: {cls.__name__} refuses {', '.join(changed)} together "
                     f"({', '.join(f'{k}={loaded[k]!r}' for k in changed)})")


def check_local_state_dict(optimizer: torch.optim.Optimizer, state_dict: object) -> None:
    """Raise ``ValueError`` naming the key unless ``optimizer`` (a local optimizer of a centralized class)
    can load ``state_dict``; changes nothing. Ours check themselves in ``load_state_dict``."""
    if isinstance(optimizer, BaseOptimizer):
        return
    for gi, group, saved in saved_groups(optimizer, state_dict):
        for key, value in saved.items():
            if key != "params" and key in group:
                try:
                    _same_kind(key, group[key], value)
                except (TypeError, ValueError) as exc:
                    raise ValueError(f"state_dict: param group {gi}: {exc}") from None
        _check_by_constructor(optimizer, group, saved, gi)
    check_param_states(optimizer, cast(dict[str, Any], state_dict), _foreign_shapes(optimizer))  # a dict: see above
