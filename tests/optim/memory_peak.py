"""The peak of live tensor bytes during a call, from torch's profiler memory timeline (every
allocation and free of torch's CPU allocator, the compiled kernels' included): deterministic, unlike
the process's RSS, so a test can hold an optimizer's first step to torch's."""

from __future__ import annotations

from collections.abc import Callable

from torch.profiler import ProfilerActivity, profile
from torch.profiler._memory_profiler import Action  # the timeline behind export_memory_timeline

__all__ = ["peak_bytes"]


def peak_bytes(fn: Callable[[], object]) -> tuple[int, int]:
    """``(peak, kept)``: the largest number of bytes allocated by ``fn()`` and alive at once, and those
    still alive when it returns (allocations before the call are not counted; frees of them lower the
    count)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        fn()
    live = peak = 0
    for _, action, _, size in prof._memory_profile().timeline:
        if action == Action.CREATE:
            live += size
        elif action == Action.DESTROY:
            live -= size
        peak = max(peak, live)
    return peak, live
