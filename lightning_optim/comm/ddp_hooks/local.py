r"""DDP comm hook ``"local"``: no gradient communication at all.

:func:`local_gradient_hook` hands DDP each bucket back untouched, so ``param.grad`` holds this rank's own
gradient (with a comm hook DDP does not divide by the world size). For optimizers that synchronise the
params themselves, and rarely: DiLoCo (every ``sync_every`` steps) and the decentralized gossip (after
each step, ``decentralized.py``). Bytes: none.
"""

# no ``from __future__ import annotations``: DDP checks the hook's return annotation at runtime
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from lightning_optim.optim.validation import check_int

from ._bucket import HookState, done

__all__ = ["LocalHookState", "local_gradient_hook"]


class LocalHookState(HookState):
    """The state of the ``"local"`` hook: how many buckets it left local (nothing else to keep)."""

    hook_name = "local"

    def __init__(self, group: Any = None, stats: Any = None) -> None:
        super().__init__(group, stats)
        self.buckets_local = 0

    def state_dict(self) -> dict[str, Any]:
        return {**self._stamp(), "buckets_local": self.buckets_local}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        state = self._check_stamp(state)
        self.buckets_local = check_int("state['buckets_local']", state.get("buckets_local"), 0)


class LocalBucketCounter(Protocol):
    """A hook state that counts the buckets it kept local (``LocalHookState``, ``DecentralizedHookState``)."""

    buckets_local: int


def local_gradient_hook(state: LocalBucketCounter, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket unreduced (this rank's own gradients; nothing is sent)."""
    state.buckets_local += 1
    return done(bucket.buffer())
