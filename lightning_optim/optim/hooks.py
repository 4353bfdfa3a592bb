"""``state_dict`` / ``load_state_dict`` with torch's hooks run where torch runs them, around our own work.

torch's ``Optimizer.state_dict`` runs its pre-hooks, packs the dict, then its post-hooks (each may return
a replacement); ``load_state_dict`` hands a shallow copy of the given dict to its pre-hooks (each may return
a replacement), loads the result and then runs its post-hooks. Our optimizers add to the dict (the 1-bit
schedule, a generator state) and check and convert a loaded one before anything changes, so calling
torch's methods from inside ours would show the hooks half a dict: a pre-hook would see the dict after our
checks, a post-hook the states before our dtype rules replaced torch's casts. Here the hooks wrap the whole
of our work instead, and the packing and installing that torch's methods do between their hooks are done
by :func:`packed_state_dict` and :func:`install_state` (no hook runs twice).
"""

from __future__ import annotations

import copy
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["install_state", "load_with_hooks", "packed_state_dict", "state_dict_with_hooks", "step_without_hooks"]


def packed_state_dict(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """torch's layout: each param by its position over the groups (first appearance), ``state`` keyed by
    those positions (the live per-param dicts, as torch returns them), the groups without their params."""
    position: dict[int, int] = {}
    groups = []
    count = 0
    for group in opt.param_groups:
        for p in group["params"]:
            position.setdefault(id(p), count)
            count += 1
        packed = {k: v for k, v in group.items() if k != "params"}
        packed["params"] = [position[id(p)] for p in group["params"]]
        groups.append(packed)
    state = {position[id(k)] if isinstance(k, Tensor) else k: v for k, v in opt.state.items()}
    return {"state": state, "param_groups": groups}


def state_dict_with_hooks(opt: torch.optim.Optimizer, build: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``build()`` between ``opt``'s state-dict pre-hooks and post-hooks."""
    for hook in opt._optimizer_state_dict_pre_hooks.values():
        hook(opt)
    state_dict = build()
    for post_hook in opt._optimizer_state_dict_post_hooks.values():
        replaced = post_hook(opt, state_dict)
        if replaced is not None:
            state_dict = replaced
    return state_dict


def load_with_hooks(opt: torch.optim.Optimizer, state_dict: Any, load: Callable[[Any], None]) -> None:
    """``load(dict)`` with the dict ``opt``'s load pre-hooks returned (given a shallow copy, as torch gives
    them), then its load post-hooks."""
    if isinstance(state_dict, dict):
        state_dict = state_dict.copy()
    for hook in opt._optimizer_load_state_dict_pre_hooks.values():
        replaced = hook(opt, state_dict)
        if replaced is not None:
            state_dict = replaced
    load(state_dict)
    for post_hook in opt._optimizer_load_state_dict_post_hooks.values():
        post_hook(opt)


def install_state(opt: torch.optim.Optimizer, groups: list[dict[str, Any]], state: dict[Any, dict[str, Any]],
                  cast: Callable[[Tensor, str, Any], Any] | None = None) -> None:
    """Make the checked ``groups`` (saved values, one per live group) and ``state`` (by saved param id) the
    optimizer's: each group keeps its live params (and its ``param_names`` when the saved one has none),
    every other value is a copy; ``state`` maps onto the params in order, as torch's loading does, each
    value through ``cast(param, key, value)`` when given."""
    new_groups = []
    for live, saved in zip(opt.param_groups, groups):
        new = copy.deepcopy({k: v for k, v in saved.items() if k != "params"})
        new["params"] = live["params"]
        if "param_names" in live and "param_names" not in new:
            new["param_names"] = live["param_names"]
        new_groups.append(new)
    by_id = {pid: p for live, saved in zip(opt.param_groups, groups)
             for pid, p in zip(saved["params"], live["params"])}
    new_state: defaultdict[Tensor, dict[str, Any]] = defaultdict(dict)
    for pid, entry in state.items():
        if pid in by_id:
            p = by_id[pid]
            new_state[p] = entry if cast is None else {k: cast(p, k, v) for k, v in entry.items()}
    opt.__setstate__({"state": new_state, "param_groups": new_groups})


def step_without_hooks(cls: type[torch.optim.Optimizer]) -> Callable[..., Any]:
    """``cls.step`` without the wrapper that runs torch's step hooks. torch adds that wrapper to a class the
    first time one of its instances is built, so a subclass whose own (wrapped) ``step`` calls its parent's
    would run every hook twice once the parent class has been built somewhere in the process."""
    step: Callable[..., Any] = cls.step
    return getattr(step, "__wrapped__", step) if getattr(step, "hooked", False) else step


def init_wrapper_hooks(opt: torch.optim.Optimizer) -> None:
    """What ``torch.optim.Optimizer.__init__`` sets up for hooks, for a wrapper that delegates its param groups
    and state to another optimizer instead of calling it: the hook registries and the patched ``step`` (torch's
    step hooks and profiler label)."""
    for hooks in ("step_pre", "step_post", "state_dict_pre", "state_dict_post", "load_state_dict_pre",
                  "load_state_dict_post"):
        setattr(opt, f"_optimizer_{hooks}_hooks", OrderedDict())
    opt._patch_step_function()
