"""The peak of live tensor bytes during a call, from the profiler's record of every allocation and free
of torch's CPU allocator (the compiled kernels' included): deterministic, unlike the process's RSS, so a
test can hold an optimizer's first step to torch's.

The raw ``[memory]`` events (bytes, signed; a start time) are summed in time order. That is the sum
``torch.profiler._memory_profiler``'s timeline gives too (same events; it additionally sorts tensors
into categories, which needs ``record_shapes``/``with_stack`` and costs ~4x the time).
"""

from __future__ import annotations

from collections.abc import Callable

from torch.profiler import ProfilerActivity, profile

__all__ = ["peak_bytes"]


def peak_bytes(fn: Callable[[], object]) -> tuple[int, int]:
    """``(peak, kept)``: the largest number of bytes allocated by ``fn()`` and alive at once, and those
    still alive when it returns (allocations before the call are not counted; frees of them lower the
    count)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    changes = sorted((event.start_ns(), event.nbytes()) for event in prof.profiler.kineto_results.events()
                     if event.name() == "[memory]")
    live = peak = 0
    for _, size in changes:
        live += size
        peak = max(peak, live)
    return peak, live
