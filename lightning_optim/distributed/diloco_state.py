"""DiLoCo's own part of a checkpoint (``state_dict()["diloco"]``): built, and checked before a load changes
anything (every refusal names the key).

    {"step": inner steps taken, "global_params": [θ_g per param], "outer_momentum": [b per param] ([] when
     outer_momentum is 0, and with SparseLoCo), "residuals": [error feedback per param (SparseLoCo: its
     accumulators), or None], "compressors": [each fragment's
     compressor state], "pending": None or {"fragment", "merge_at", "deltas"} (an overlapped exchange whose
     average is merged at step ``merge_at``), "settings": {"sync_every", "fragments", "overlap",
     "compressor"}, "world_size", "rank"}

The residuals and the compressors' error buffers are this rank's own: a load on another rank or world size
is refused while they hold anything (save one checkpoint per rank). The inner optimizer's state sits beside
it, under ``state`` and ``param_groups``, as its own ``state_dict()`` gives them.
"""
from __future__ import annotations

import copy
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

__all__ = ["Loaded", "check_section", "SETTINGS"]

SETTINGS = ("sync_every", "fragments", "overlap", "compressor")


@dataclass
class Loaded:
    """A checked section, as the copies the optimizer takes."""

    step: int
    global_params: list[Tensor]
    outer_momentum: list[Tensor]
    residuals: list[Tensor | None]
    compressors: list[Any]
    pending: tuple[int, int, list[Tensor]] | None


def _tensors(key: str, value: object, like: Sequence[Tensor], *, optional: bool = False) -> list[Any]:
    """``value`` must be a list of tensors shaped and typed like ``like`` (None entries where ``optional``)."""
    if not isinstance(value, (list, tuple)) or len(value) != len(like):
        raise ValueError(f"state_dict: diloco '{key}' must be a list of {len(like)} tensors, got "
                         f"{type(value).__name__}{f' of {len(value)}' if isinstance(value, (list, tuple)) else ''}")
    out: list[Any] = []
    for i, (t, ref) in enumerate(zip(value, like)):
        if t is None and optional:
            out.append(None)
            continue
        if not isinstance(t, Tensor) or t.dtype != ref.dtype or t.shape != ref.shape:
            got = f"a {t.dtype} tensor of shape {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"state_dict: diloco '{key}'[{i}] must be a {ref.dtype} tensor of shape "
                             f"{tuple(ref.shape)}, got {got}")
        out.append(t.detach().clone().to(ref.device))
    return out


def _count(key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"state_dict: diloco '{key}' must be an int >= 0, got {value!r}")
    return int(value)


def _pending(value: object, step: int, bounds: Sequence[tuple[int, int]], globals_: Sequence[Tensor],
             overlap: bool) -> tuple[int, int, list[Tensor]] | None:
    if value is None:
        return None
    if not overlap:
        raise ValueError("state_dict: diloco 'pending' holds an exchange, but overlap=False never leaves one")
    if not isinstance(value, Mapping) or set(value) != {"fragment", "merge_at", "deltas"}:
        raise ValueError("state_dict: diloco 'pending' must be None or {'fragment', 'merge_at', 'deltas'}")
    fragment = _count("pending.fragment", value["fragment"])
    if fragment >= len(bounds):
        raise ValueError(f"state_dict: diloco 'pending.fragment' must be in [0, {len(bounds) - 1}], got {fragment}")
    if value["merge_at"] != step + 1 or isinstance(value["merge_at"], bool):
        raise ValueError(f"state_dict: diloco 'pending.merge_at' must be step + 1 = {step + 1} (merged one inner "
                         f"step after it started), got {value['merge_at']!r}")
    lo, hi = bounds[fragment]
    return fragment, step + 1, _tensors("pending.deltas", value["deltas"], globals_[lo:hi])


def _compressors(value: object, live: Sequence[Any]) -> list[Any]:
    if not isinstance(value, (list, tuple)) or len(value) != len(live):
        raise ValueError(f"state_dict: diloco 'compressors' must be a list of {len(live)} states (one per fragment)")
    out: list[Any] = []
    for f, (state, compressor) in enumerate(zip(value, live)):
        if compressor is None:
            if state not in (None, {}):
                raise ValueError(f"state_dict: diloco 'compressors'[{f}] holds a state, but no compressor is set")
            out.append(None)
            continue
        trial = copy.deepcopy(compressor)  # the live one changes only once everything passed
        try:
            trial.load_state_dict(state)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"state_dict: diloco 'compressors'[{f}]: {exc}") from None
        out.append(trial)
    return out


def _holds_rank_state(section: Mapping[str, Any]) -> bool:
    def filled(state: object) -> bool:
        if isinstance(state, Tensor):
            return True
        if isinstance(state, Mapping):
            return any(filled(v) for k, v in state.items() if k not in ("generator", "draws", "world_size", "rank"))
        if isinstance(state, (list, tuple)):
            return any(filled(v) for v in state)
        return False

    return filled(section.get("residuals")) or filled(section.get("compressors"))


def check_section(section: object, *, settings: Mapping[str, Any], bounds: Sequence[tuple[int, int]],
                  global_params: Sequence[Tensor], outer_momentum: Sequence[Tensor], compressors: Sequence[Any],
                  origin: tuple[int, int]) -> Loaded:
    """``section`` checked against the live optimizer (nothing changes); its copies to take."""
    if not isinstance(section, Mapping):
        raise ValueError("state_dict: no 'diloco' entry (a dict): not a DiLoCo state dict; a bare inner optimizer's "
                         "state dict loads into DiLoCo.inner")
    saved = section.get("settings")
    if not isinstance(saved, Mapping):
        raise ValueError("state_dict: diloco 'settings' must be a dict of " + ", ".join(SETTINGS))
    for key in SETTINGS:
        if saved.get(key) != settings[key] or type(saved.get(key)) is not type(settings[key]):
            raise ValueError(f"state_dict: diloco 'settings' {key}={saved.get(key)!r} differs from this optimizer's "
                             f"{key}={settings[key]!r}: the schedule, fragments and compressor state would not fit")
    where = (_count("world_size", section.get("world_size")), _count("rank", section.get("rank")))
    if where[0] < 1 or where[1] >= where[0]:
        raise ValueError(f"state_dict: diloco 'world_size' and 'rank' must be an int >= 1 and a rank in [0, "
                         f"world_size), got {where[0]} and {where[1]}")
    if where != origin and _holds_rank_state(section):
        raise ValueError(f"state_dict: diloco 'rank': saved by rank {where[1]} of {where[0]}, loaded on rank "
                         f"{origin[1]} of {origin[0]}; its error-feedback state is per rank (load each rank's own)")
    step = _count("step", section.get("step"))
    return Loaded(
        step=step,
        global_params=_tensors("global_params", section.get("global_params"), global_params),
        outer_momentum=_tensors("outer_momentum", section.get("outer_momentum"), outer_momentum),
        residuals=_tensors("residuals", section.get("residuals"), global_params, optional=True),
        compressors=_compressors(section.get("compressors"), compressors),
        pending=_pending(section.get("pending"), step, bounds, global_params, settings["overlap"]),
    )
