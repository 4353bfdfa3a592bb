"""Names of a package that live in a module importing a heavy framework (Lightning), loaded on first use
(PEP 562), so the package's framework-free part can be imported without it."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from lightning_optim.extras import require


def lazy_names(package: str, homes: dict[str, str],
               extra: str = "lightning") -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``homes`` maps each lazy name to the module defining it; a
    name whose framework is missing raises the ``ImportError`` of :func:`lightning_optim.extras.require`."""
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str) -> Any:
        if name in homes:
            require(extra, f"{package}.{name}")
            return getattr(importlib.import_module(homes[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(homes))

    return __getattr__, __dir__
