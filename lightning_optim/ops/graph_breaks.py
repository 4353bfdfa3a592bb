"""Every graph break torch.compile takes in a function, with where it happened.

``torch._dynamo.explain`` lists a break's reason only for breaks in the outermost frame it traces: a
break inside an inlined call (a pybind kernel called from ``optimizer.step()``) restarts the trace
and shows up in its counts, not in its reasons. Dynamo's ``graph_breaks`` log names every break
with its location and user stack, so this reads that log while running ``explain``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["GraphBreak", "explain_breaks"]

PACKAGE_DIR = str(Path(__file__).resolve().parent.parent)
_LOGGER = "torch._dynamo.symbolic_convert.__graph_breaks"
_AT = re.compile(r"in user code at (.+?):(\d+)")
_FILE = re.compile(r'File "(.+?)", line')
_THIS = str(Path(__file__).resolve())


@dataclass
class GraphBreak:
    where: str  # "file:line" of the break
    reason: str  # the first line of dynamo's reason
    stack: str  # dynamo's user code traceback ("" for a repeat of a break already logged)

    @property
    def in_lightning_optim(self) -> bool:
        """The break is at, or its stack passes through, a file of the package (this module, which
        calls ``explain``, excluded)."""
        files = [self.where.rsplit(":", 1)[0], *_FILE.findall(self.stack)]
        return any(f.startswith(PACKAGE_DIR) and f != _THIS for f in files)


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.breaks: list[GraphBreak] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        at = _AT.search(text.splitlines()[0])
        where = f"{at.group(1)}:{at.group(2)}" if at else "?"
        body = text.split("Graph Break Reason:", 1)[-1].strip().splitlines()
        reason = next((line.strip() for line in body[1:] if line.strip()), body[0] if body else "")
        stack = text.split("User code traceback:", 1)[1] if "User code traceback:" in text else ""
        self.breaks.append(GraphBreak(where, reason, stack))


def explain_breaks(fn: Callable[..., Any], *args: Any) -> tuple[Any, list[GraphBreak]]:
    """``torch._dynamo.explain(fn)(*args)`` (after ``torch._dynamo.reset()``) and every break it took
    (a break repeated while dynamo restarts a trace is listed each time). Resets torch's log settings."""
    handler = _Collect()
    logger = logging.getLogger(_LOGGER)
    torch._logging.set_logs(graph_breaks=True)
    logger.addHandler(handler)
    logger.propagate = False  # collected here, not printed
    try:
        torch._dynamo.reset()
        out = torch._dynamo.explain(fn)(*args)
    finally:
        logger.removeHandler(handler)
        logger.propagate = True
        torch._logging.set_logs()
    return out, handler.breaks
