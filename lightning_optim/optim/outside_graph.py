"""Run a call eagerly from a traced step. A module of its own: ``torch.compiler.disable`` imports
``torch._dynamo`` (seconds of ``import lightning_optim`` on plain torch), which only a traced step needs, and
a traced step has imported it already."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


@torch.compiler.disable
def eagerly(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, run outside the graph being traced (one graph break at the call)."""
    return fn(*args)
