"""DDP communication hooks by name, framework-free, on any device and backend (gloo on CPU too):

    from lightning_optim.comm.ddp_hooks import register_comm_hook
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = register_comm_hook(ddp, "topk", ratio=0.01)          # before the first backward
    ...
    torch.save(state.state_dict(), f"hook.rank{dist.get_rank()}.pt")   # per rank: residuals differ

=================  ==========================  ===============================================
name               state (arguments)           per bucket
=================  ==========================  ===============================================
``"topk"``         ``TopKHookState``           top-k of each param, error feedback, all-gather
``"randomk"``      ``RandomKHookState``        random-k, error feedback, all-reduce/all-gather
``"sign_sgd"``     ``SignSGDHookState``        scaled sign (EF-SignSGD) or majority vote
``"powersgd"``     ``PowerSGDHookState``       torch's ``powerSGD_hook`` (counted, layout-safe)
``"decentralized"`` ``DecentralizedHookState``  nothing: local gradients; gossip after the step
``"local"``        ``LocalHookState``          nothing: local gradients (DiLoCo syncs the params)
``"fp16_compress"`` ``FP16CompressHookState``  torch's ``fp16_compress_hook`` (counted, bounded)
=================  ==========================  ===============================================

Every state keeps its per-rank state by param name (DDP rebuilds its buckets after the first
iteration), counts the bytes it sends in ``comm_stats()`` (or ``stats=``), bounds every collective
by ``collective_timeout()`` and saves per rank with ``state_dict()`` / ``load_state_dict()``.
``"decentralized"`` needs ``state.after_step(ddp.module.parameters())`` after each optimizer step.
Equations and bytes: each module's docstring; docs/guides/low_communication.md.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from lightning_optim.catalogue import STRATEGY_ALIASES
from lightning_optim.renames import warn_renamed

from ._bucket import HookState, ParamNames
from .compressed import CompressionHookState, RandomKHookState, SignSGDHookState, TopKHookState, compression_hook
from .decentralized import DecentralizedHookState
from .fp16 import FP16CompressHookState, fp16_compress_hook
from .local import LocalHookState, local_gradient_hook
from .powersgd import PowerSGDHookState, powersgd_hook
from .release import ReleaseHookState, register_ddp_release, release_hook

__all__ = [
    "HOOKS",
    "HookState",
    "ParamNames",
    "CompressionHookState",
    "TopKHookState",
    "RandomKHookState",
    "SignSGDHookState",
    "PowerSGDHookState",
    "DecentralizedHookState",
    "LocalHookState",
    "FP16CompressHookState",
    "compression_hook",
    "powersgd_hook",
    "local_gradient_hook",
    "fp16_compress_hook",
    "ReleaseHookState",
    "release_hook",
    "register_ddp_release",
    "make_state",
    "register_comm_hook",
]

# name -> (state class, hook)
HOOKS: dict[str, tuple[type[HookState], Callable]] = {
    "topk": (TopKHookState, compression_hook),
    "randomk": (RandomKHookState, compression_hook),
    "sign_sgd": (SignSGDHookState, compression_hook),
    "powersgd": (PowerSGDHookState, powersgd_hook),
    "decentralized": (DecentralizedHookState, local_gradient_hook),
    "fp16_compress": (FP16CompressHookState, fp16_compress_hook),
    "local": (LocalHookState, local_gradient_hook),
}


def make_state(name: str, **kwargs: Any) -> HookState:
    """The state of hook ``name`` (arguments checked; nothing collective happens). An old name
    (:data:`~lightning_optim.catalogue.STRATEGY_ALIASES`: ``"signsgd"``) warns and means its new one."""
    if name in STRATEGY_ALIASES:
        warn_renamed("hook name", name, STRATEGY_ALIASES[name])
        name = STRATEGY_ALIASES[name]
    if name not in HOOKS:
        raise ValueError(f"hook name must be one of {sorted(HOOKS)}, got {name!r}")
    return HOOKS[name][0](**kwargs)


def register_comm_hook(ddp_model: nn.Module, name: str | HookState, **kwargs: Any) -> HookState:
    """Register hook ``name`` (or the hook of a ready ``HookState``) on ``ddp_model``; return its state.

    Collective for ``"decentralized"`` (the ranks agree on the topology) and ``"powersgd"`` (on the
    arguments): every rank calls it together. torch allows one comm hook per model, registered before
    the first backward.
    """
    if not isinstance(ddp_model, nn.parallel.DistributedDataParallel):
        raise TypeError(f"ddp_model must be a torch.nn.parallel.DistributedDataParallel, got "
                        f"{type(ddp_model).__name__}")
    if isinstance(name, HookState):
        if kwargs:
            raise TypeError("pass either a ready state or a name with its arguments, not both")
        state = name
    else:
        state = make_state(name, **kwargs)
    state.attach(ddp_model)
    ddp_model.register_comm_hook(state, HOOKS[state.hook_name][1])
    return state
