"""One flat tensor per list for a bucket whose tensors are adjacent views of one buffer.

An elementwise kernel (Adam, SGD, Lion) computes the same values whether it gets 2000 tensors or one
tensor spanning them: where the params, grads and every state of a bucket are each laid out back to
back in one storage, in bucket order (``flatten_parameters`` for params and grads, ``pack_states`` for
states), the call takes one span per run of adjacent tensors instead, and the binding checks and the
kernel streams one buffer instead of 2000 small allocations.

The runs of a bucket are worked out once and cached with it (``BaseOptimizer`` keeps one cache dict per
bucket slice of its plan, dropped when a plan is rebuilt). A later step reuses the spans only if every
list holds the same tensor objects as when they were made and no param has moved (``p.data = ...``);
otherwise the runs are worked out again. Grads that are new tensors every step (``zero_grad(set_to_none=
True)`` without flattened grads) never repeat: after two misses the bucket stops trying.
"""

from __future__ import annotations

import operator
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

__all__ = ["adjacent_runs", "coalesced", "same_items", "span"]

GIVE_UP_AFTER = 2


def _follows(a: Tensor, b: Tensor) -> bool:
    """``b`` starts where ``a`` ends, in the same storage, same dtype, both contiguous."""
    return (a.dtype == b.dtype and a.is_contiguous() and b.is_contiguous()
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and a.data_ptr() + a.numel() * a.element_size() == b.data_ptr())


def adjacent_runs(lists: list[list[Tensor]]) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` covering positions ``0..n``: maximal runs where every list's tensors follow
    each other in memory."""
    n = len(lists[0])
    runs, start = [], 0
    for i in range(1, n):
        if not all(_follows(tensors[i - 1], tensors[i]) for tensors in lists):
            runs.append((start, i))
            start = i
    runs.append((start, n))
    return runs


def span(tensors: list[Tensor]) -> Tensor:
    """One 1-D tensor over adjacent ``tensors`` (their shared storage, from the first one's offset)."""
    first = tensors[0]
    if len(tensors) == 1:
        return first.view(-1)
    total = sum(t.numel() for t in tensors)
    return torch.empty(0, dtype=first.dtype, device=first.device).set_(
        first.untyped_storage(), first.storage_offset(), (total,), (1,))


def _param_ptrs(params: list[Tensor], ext: ModuleType | None) -> Any:
    """Where every param's data starts: one bytes object from the extension, else a list of ints."""
    found = ext.data_ptrs(params) if ext is not None else None
    return found if found is not None else list(map(Tensor.data_ptr, params))


def same_items(a: list[Any], b: list[Any], ext: ModuleType | None = None) -> bool:
    """``a`` and ``b`` hold the same objects in the same order (identity: tensors compare elementwise);
    ``ext``: the compiled module, one pointer comparison per item instead of one Python call."""
    if ext is not None and type(a) is list and type(b) is list:
        return ext.same_items(a, b)
    return len(a) == len(b) and all(map(operator.is_, a, b))


def _same(lists: dict[str, list[Tensor]], entry: dict[str, Any], ext: ModuleType | None) -> bool:
    return (all(same_items(lists[name], tensors, ext) for name, tensors in entry["originals"].items())
            and _param_ptrs(lists["params"], ext) == entry["param_ptrs"])


def coalesced(cache: dict[str, Any] | None, lists: dict[str, list[Tensor]],
              ext: ModuleType | None = None) -> dict[str, list[Tensor]]:
    """``lists`` with adjacent tensors merged into spans where that shortens them, else ``lists`` as given.

    ``lists`` maps a kernel's list arguments to their tensors (``params`` and ``grads`` required, empty
    lists allowed); ``cache``: the bucket's cache dict (None: work it out without keeping it); ``ext``:
    the compiled module, whose one-call pointer read makes the per-step check cheaper."""
    params = lists["params"]
    if len(params) < 2 or torch.compiler.is_compiling():
        return lists
    cache = {} if cache is None else cache
    entry = cache.get("entry")
    if entry is not None:
        if _same(lists, entry, ext):
            return entry["merged"]
        cache["misses"] = cache.get("misses", 0) + 1
        del cache["entry"]
    if cache.get("misses", 0) >= GIVE_UP_AFTER:
        return lists
    names = [name for name, tensors in lists.items() if tensors]
    runs = adjacent_runs([lists[name] for name in names])
    if len(runs) == len(params):  # nothing adjacent
        cache["misses"] = cache.get("misses", 0) + 1
        return lists
    merged = {name: [span(tensors[a:b]) for a, b in runs] if tensors else tensors for name, tensors in lists.items()}
    cache["entry"] = {"originals": {name: list(tensors) for name, tensors in lists.items()},
                      "param_ptrs": _param_ptrs(params, ext), "merged": merged}
    return merged
