"""The per-param step count, kept as torch.optim keeps it, and read as a number at the edge.

``state["step"]`` is a 0-dim floating-point tensor on the CPU (float32; float64 while torch's default
dtype is float64), as ``torch.optim.Adam`` and its siblings keep it: code written against torch.optim
calls ``.item()`` / ``.detach()`` on it, and torch's own tools (``Optimizer.load_state_dict``,
``torch.distributed.checkpoint``, Lightning's ``_optimizer_to_device``, which leaves ``step`` where it
is) expect a tensor there. The math and the kernels take the count as a Python int: one CPU
``.item()`` per bucket and step (no device sync: the tensor never leaves the CPU).

Like torch's, a float32 count is exact up to 2**24 steps (16.7M), past which ``+= 1`` no longer moves it.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch
from torch import Tensor

from lightning_optim.optim.validation import is_bool

__all__ = ["MAX_STEP", "BucketSteps", "check_step", "new_step", "step_dtype", "step_value"]

MAX_STEP = 2**53  # the largest count every float64 below it holds exactly


def step_dtype() -> torch.dtype:
    """The dtype torch.optim gives a CPU step tensor (its ``_get_scalar_dtype()`` rule)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def new_step(count: int = 0) -> Tensor:
    """A fresh step tensor holding ``count``."""
    return torch.tensor(float(count), dtype=step_dtype())


def step_value(step: Tensor | int) -> int:
    """The count a step tensor (or a plain int) holds."""
    return int(step.item()) if isinstance(step, Tensor) else int(step)


def check_step(value: Any, name: str) -> int:
    """A saved counter (``step``, Ranger's ``la_step``) as an int: a whole number in [0, ``MAX_STEP``], given
    as a Python or numpy number or a one-element real tensor (torch saves a float tensor). Anything else
    (NaN, inf, negative, fractional, a string, a bool, a bigger tensor) is a ``ValueError`` that starts
    with ``name`` (where the counter sits, e.g. ``"state_dict: param 0 (group 0) step"``)."""
    valid = f"a whole number in [0, {MAX_STEP}] (an int, or a one-element real tensor holding one)"
    shown = repr(value)
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            raise ValueError(f"{name} must be {valid}, got a {value.dtype} tensor of shape {tuple(value.shape)}")
        value = value.item()
        shown = f"tensor({value})"
    if is_bool(value) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be {valid}, got {type(value).__name__} ({shown})")
    if isinstance(value, numbers.Integral):
        count = int(value)
        whole = 0 <= count <= MAX_STEP
    else:
        number = float(value)
        whole = math.isfinite(number) and 0 <= number <= MAX_STEP and number.is_integer()
        count = int(number) if whole else 0
    if not whole:
        raise ValueError(f"{name} must be {valid}, got {shown}")
    return count


class BucketSteps:
    """The step counts of a bucket of params that step together.

    Their step tensors become 0-dim views of one CPU buffer, so a step moves them all with one ``add_``
    (one tiny op per param costs about as much as the whole update of a few hundred small tensors); a
    tensor replaced since (by hand) is moved on its own. ``count`` is the bucket's count as an int: an
    eager step reads it from the first tensor, a traced one (reading a tensor's value would break the
    graph) counts on from the value read when the bucket was made.
    """

    def __init__(self, states: list[dict[str, Any]]) -> None:
        steps = [s["step"] for s in states]
        self.count = step_value(steps[0])
        self.flat: Tensor | None = None
        self.views: list[Tensor] = []
        first = steps[0]
        if len(steps) > 1 and all(t.dim() == 0 and t.device.type == "cpu" and t.dtype == first.dtype for t in steps):
            self.flat = torch.stack(steps)
            self.views = list(self.flat.unbind(0))
            for state, view in zip(states, self.views):
                state["step"] = view

    def _move(self, states: list[dict[str, Any]], by: int) -> None:
        if self.flat is not None and all(s["step"] is v for s, v in zip(states, self.views)):
            self.flat.add_(by)
        else:
            torch._foreach_add_([s["step"] for s in states], by)

    def advance(self, states: list[dict[str, Any]]) -> int:
        """Count one step in every state of the bucket; returns the new count."""
        self._move(states, 1)
        self.count = self.count + 1 if torch.compiler.is_compiling() else step_value(states[0]["step"])
        return self.count

    def rewind(self, states: list[dict[str, Any]]) -> None:
        """Take back the step :meth:`advance` counted (a step that raised)."""
        self._move(states, -1)
        self.count -= 1
