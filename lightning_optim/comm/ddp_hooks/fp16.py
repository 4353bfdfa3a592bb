"""``"fp16_compress"``: torch's own ``fp16_compress_hook``, on any device, counted and bounded.

Each bucket is cast to fp16, summed over the ranks, divided by the world size and cast back
(torch.distributed.algorithms.ddp_comm_hooks.default_hooks; not rewritten here): half of fp32
DDP's bytes, :math:`2\\frac{W-1}{W}\\cdot 2d` per rank and bucket, no error feedback (the
rounding to fp16 is the only loss). Bytes are added to ``comm_stats()`` when the bucket's
all-reduce completes; the wait is bounded by ``collective_timeout()``. No per-rank state.
"""
# no ``from __future__ import annotations``: DDP checks the hook's return annotation at runtime
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from ..timeouts import collective_timeout
from ._bucket import HookState, bounded, done, stats_lock

__all__ = ["FP16CompressHookState", "fp16_compress_hook"]


class FP16CompressHookState(HookState):
    """The group and the byte counter of :func:`fp16_compress_hook` (nothing per rank to save)."""

    hook_name = "fp16_compress"

    def state_dict(self) -> dict[str, Any]:
        return self._stamp()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._check_stamp(state)


def fp16_compress_hook(state: FP16CompressHookState, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: torch's fp16 compression of the bucket, counted in ``comm_stats()`` and bounded."""
    world = state.world_size()
    if world == 1:
        return done(bucket.buffer())
    numel = bucket.buffer().numel()

    def count() -> None:
        with stats_lock:
            state.stats.add_full_precision(numel, world, 2)  # fp16 on the wire, its fp32 equivalent beside

    return bounded(default_hooks.fp16_compress_hook(state.group, bucket), collective_timeout(),
                   "DDP bucket fp16 all_reduce", on_success=count)
