"""Start a 1-bit optimizer from a running job's full-precision Adam/AdamW (or LAMB) state dict.

The natural way to skip a long full-precision warmup: train with DDP + Adam, then resume the
checkpoint with a 1-bit optimizer. What carries over, per param: ``exp_avg``, ``exp_avg_sq`` (as
fp32) and the step count ``s``; the schedule's step becomes ``s``, so the stage follows from it
(``s >= freeze_step``: the next step compresses, with the loaded variance frozen; its bias correction
counts the ``s`` variance updates the saved Adam made). Per group, ``lr`` and ``initial_lr`` (the
running LR schedule) come from the saved dict; the other hyper-parameters stay the 1-bit
optimizer's own. The error buffers start at zero (a full-precision run has none).

Refused with a ``ValueError`` naming what is wrong: another algorithm's state (``momentum_buffer``,
``max_exp_avg_sq``: AMSGrad...), a state without a step count (a 1-bit dict that lost its ``"onebit"``
entry, as ``torch.distributed.checkpoint``'s ``get_optimizer_state_dict`` drops it), a step that is not a
whole number, a different number of groups or params, shapes that differ, and a
LAMB state saved at or after ``freeze_step`` for ``OnebitLamb`` (its frozen trust ratios are
recorded during warmup and a plain LAMB has none).
"""
from __future__ import annotations

from typing import Any, Protocol

import torch

from lightning_optim.onebit.layout import local_tensor
from lightning_optim.optim.steps import check_step


class OnebitOptimizer(Protocol):
    """What the conversion reads of a 1-bit optimizer (``onebit.base.OnebitOptimizer`` has it; this
    module sits below it and does not import it)."""

    param_groups: list[dict[str, Any]]
    _plain_state_extras: tuple[str, ...]

    def _schedule_after_plain_steps(self, step: int) -> dict[str, Any]: ...
    def _world(self) -> tuple[int, int]: ...

_MOMENTS = ("exp_avg", "exp_avg_sq")
_ALLOWED = {"step", "exp_avg", "exp_avg_sq", "kahan_comp"}
_CARRIED_GROUP_KEYS = ("lr", "initial_lr")




def plain_to_onebit(optimizer: OnebitOptimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` (torch.optim / lightning_optim Adam, AdamW, Lamb ...) in ``optimizer``'s own format."""
    name = type(optimizer).__name__
    saved_groups, saved_state = state_dict.get("param_groups"), state_dict.get("state")
    if not isinstance(saved_groups, list) or not isinstance(saved_state, dict):
        raise ValueError(f"state_dict: expected 'state' and 'param_groups' entries, got keys {sorted(state_dict)}")
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"state_dict: {len(saved_groups)} param groups saved, {name} has {len(optimizer.param_groups)}")
    state: dict[Any, dict[str, Any]] = {}
    groups, steps = [], set()
    for gi, (group, saved) in enumerate(zip(optimizer.param_groups, saved_groups)):
        ids = saved["params"]
        if len(ids) != len(group["params"]):
            raise ValueError(
                f"state_dict: param group {gi} holds {len(ids)} params, {name}'s holds {len(group['params'])}")
        new_group = {k: v for k, v in group.items() if k != "params"}
        new_group.update({k: saved[k] for k in _CARRIED_GROUP_KEYS if k in saved})
        new_group["params"] = ids
        groups.append(new_group)
        for p, pid in zip(group["params"], ids):
            entry = saved_state.get(pid)
            if not entry:
                continue
            if "step" not in entry:  # every full-precision Adam/LAMB counts; a 1-bit dict keeps its count apart
                raise ValueError(
                    f"state_dict: param {pid} holds state {sorted(entry)} but no step count, and the dict has no "
                    f"'onebit' entry: a {name} state dict that lost its 'onebit' entry (the stage counters and error "
                    "buffers; torch.distributed.checkpoint's get_optimizer_state_dict keeps only 'state' and "
                    "'param_groups'), which would restart at step 0. Save the whole state_dict() (for DCP: "
                    "onebit.fsdp_checkpoint.rank_state / load_rank_state)")
            keys, allowed = set(entry), _ALLOWED | set(optimizer._plain_state_extras)
            if not keys <= allowed or not set(_MOMENTS) <= keys:
                raise ValueError(
                    f"state_dict: param {pid} holds state {sorted(keys)}; {name} takes Adam/AdamW/LAMB moments "
                    f"{sorted((*_MOMENTS, 'step'))} (missing: {sorted(set(_MOMENTS) - keys)}, "
                    f"not {name}'s: {sorted(keys - allowed)})"
                )
            shape = tuple(local_tensor(p).shape)  # a sharded param's moments are its shard's
            for key in _MOMENTS:
                if tuple(entry[key].shape) != shape:
                    raise ValueError(f"state_dict: param {pid} {key} has shape {tuple(entry[key].shape)}, "
                                     f"the param {shape}")
            converted = {key: entry[key].detach().to(torch.float32) for key in _MOMENTS}
            for key in optimizer._plain_state_extras:  # e.g. LAMB's last trust ratio
                if key in entry:
                    converted[key] = torch.as_tensor(entry[key], dtype=torch.float32).detach().clone()
            if "kahan_comp" in entry and entry["kahan_comp"].dtype == p.dtype:
                converted["kahan_comp"] = entry["kahan_comp"]
            state[pid] = converted
            steps.add(check_step(entry["step"], f"state_dict: param {pid} (group {gi}) step"))
    step = max(steps, default=0)
    schedule = optimizer._schedule_after_plain_steps(step)
    return {
        "state": state,
        "param_groups": groups,
        "onebit": {
            "optimizer": name,
            "schedule": schedule,
            "world_size": optimizer._world()[0],
            "rank": optimizer._world()[1],
            "worker_error": None,
            "server_error": None,
        },
    }
