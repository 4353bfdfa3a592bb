"""Argument checks shared by every optimizer.

Each check raises before the optimizer exists, so nothing is ever half-built, and each
message names the argument and the range it must lie in.
"""

from __future__ import annotations

import math
import numbers
import sys
from collections.abc import Sequence

import torch


def is_bool(value: object) -> bool:
    """A Python or numpy bool. numpy is never imported here (the core needs torch alone): a numpy bool can only
    exist where numpy is already loaded."""
    numpy = sys.modules.get("numpy")
    return isinstance(value, bool) or (numpy is not None and isinstance(value, numpy.bool_))


def is_numpy_scalar(value: object) -> bool:
    """A numpy scalar (``numpy.float32(1e-3)``), told without importing numpy (see :func:`is_bool`)."""
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, numpy.generic)


def _finite_number(name: str, value: object) -> float:
    # numbers.Real: Python and numpy ints/floats (torch accepts np.float32(1e-3)); bools are refused
    if is_bool(value) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} ({value!r})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


def check_non_negative(name: str, value: object) -> float:
    """``value`` must lie in [0, inf)."""
    value = _finite_number(name, value)
    if value < 0:
        raise ValueError(f"{name} must be in [0, inf), got {value}")
    return value


def check_lr(value: object, owner: str, *, tensor_ok: bool = True) -> float:
    """``lr`` in [0, inf): a real number or, where ``tensor_ok``, a one-element floating-point tensor (as
    torch.optim allows, for torch.compile with a scheduler; kept as given, so a scheduler fills it in place).
    Returns its value."""
    if isinstance(value, torch.Tensor):
        if not tensor_ok:
            raise TypeError(f"lr: {owner} takes a float lr, got a tensor (a tensor lr is for the "
                            f"single-process optimizers under torch.compile)")
        if value.numel() != 1 or not value.is_floating_point() or value.requires_grad:
            raise ValueError(f"lr: a tensor lr must be a one-element floating-point tensor without grad, got "
                             f"shape {tuple(value.shape)}, {value.dtype}, requires_grad={value.requires_grad}")
        return check_non_negative("lr", value.item())
    return check_non_negative("lr", value)


def check_positive(name: str, value: object, *, allow_inf: bool = False) -> float:
    """``value`` must lie in (0, inf) (or (0, inf] with ``allow_inf``)."""
    if allow_inf and value == math.inf:
        return math.inf
    value = _finite_number(name, value)
    if value <= 0:
        raise ValueError(f"{name} must be in (0, inf{']' if allow_inf else ')'}, got {value}")
    return value


def check_unit_interval(name: str, value: object, *, closed_right: bool = False) -> float:
    """``value`` must lie in [0, 1) (or [0, 1] with ``closed_right``)."""
    value = _finite_number(name, value)
    upper_ok = value <= 1 if closed_right else value < 1
    if value < 0 or not upper_ok:
        bracket = "]" if closed_right else ")"
        raise ValueError(f"{name} must be in [0, 1{bracket}, got {value}")
    return value


def check_betas(betas: Sequence[float], count: int = 2, name: str = "betas") -> tuple[float, ...]:
    """``betas`` must hold ``count`` numbers, each in [0, 1)."""
    if isinstance(betas, (str, bytes)) or not isinstance(betas, Sequence) or len(betas) != count:
        raise TypeError(f"{name} must be a sequence of {count} numbers in [0, 1), got {betas!r}")
    return tuple(check_unit_interval(f"{name}[{i}]", b) for i, b in enumerate(betas))


def check_int(name: str, value: object, minimum: int) -> int:
    """``value`` must be an integer (Python or numpy) >= ``minimum``."""
    if is_bool(value) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int in [{minimum}, inf), got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be in [{minimum}, inf), got {value}")
    return int(value)


def plain_numbers(value: object) -> object:
    """numpy scalars (also inside tuples/lists) as Python numbers, so groups hold what torch expects."""
    if is_numpy_scalar(value):
        return value.item()  # type: ignore[attr-defined]  # a numpy scalar
    if isinstance(value, (tuple, list)) and any(map(is_numpy_scalar, value)):
        return type(value)(v.item() if is_numpy_scalar(v) else v for v in value)
    return value


def check_flag(name: str, value: object) -> bool:
    """``value`` must be a bool (catches strings such as ``"false"`` from configs)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def check_optional_flag(name: str, value: object) -> bool | None:
    """``value`` must be True, False or None (None means: decide automatically)."""
    if value is None:
        return None
    return check_flag(name, value)


def check_generator_state(name: str, saved: object) -> torch.Tensor:
    """A saved ``torch.Generator`` state: a uint8 tensor that torch takes (tried on a scratch generator, since
    torch refuses another size with a RuntimeError). Raises ``ValueError`` naming ``name``; changes nothing."""
    if not isinstance(saved, torch.Tensor) or saved.dtype != torch.uint8:
        raise ValueError(f"state: '{name}' must be a torch.Generator state (a uint8 tensor), got "
                         f"{getattr(saved, 'dtype', type(saved).__name__)}")
    try:
        torch.Generator().set_state(saved.clone())
    except RuntimeError as exc:
        raise ValueError(f"state: '{name}' is not a torch.Generator state ({exc})") from None
    return saved


def check_distinct_params(params: Sequence[torch.Tensor], taken: Sequence[torch.Tensor] = ()) -> None:
    """``params`` must not repeat a tensor nor hold one of ``taken`` (the other groups'): torch only warns
    about a repeat within a group, and a repeated param would be stepped, and sent, twice."""
    seen = {id(p) for p in taken}
    for i, p in enumerate(params):
        if id(p) in seen:
            raise ValueError(f"params: param {i} of the group (shape {tuple(p.shape)}) appears more than once, in "
                             "this group or in another param group; each param must appear once")
        seen.add(id(p))
