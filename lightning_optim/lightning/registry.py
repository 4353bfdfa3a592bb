"""Register the 1-bit strategy names in Lightning's strategy registries, without importing Lightning.

Lightning 2.x has no plugin discovery for strategies, so ``import lightning_optim`` calls
:func:`install`: for each of ``lightning.pytorch`` and ``pytorch_lightning``

* already imported: the names are registered at once;
* not imported yet: a finder on ``sys.meta_path`` waits for that package's import to finish and
  registers then (so ``import lightning_optim`` itself stays cheap: no Lightning import);
* not installed: nothing happens.

Names: the strategies of :mod:`lightning_optim.catalogue` (``onebit_adam``, ``zero_one_adam``,
``onebit_lamb``; the comm-hook ones ``powersgd``, ``topk``, ``randomk``, ``signsgd``,
``decentralized``). A registration failure never breaks
the user's import of Lightning; it becomes one warning. :func:`register` does the work and can
be called by hand.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import threading
import warnings
from types import ModuleType
from typing import Any

from lightning_optim.catalogue import STRATEGIES

__all__ = ["install", "register", "NAMES"]

NAMES = tuple(STRATEGIES)
# Lightning package -> module holding our strategy classes for it
_FLAVOURS = {
    "lightning.pytorch": "lightning_optim.lightning.strategies",
    "pytorch_lightning": "lightning_optim.lightning.pl_strategies",
}
_lock = threading.RLock()


def register(package: str = "lightning.pytorch") -> list[str]:
    """Register the strategies in ``package``'s ``StrategyRegistry`` (imports it); returns the names added."""
    with _lock:
        registry = importlib.import_module(f"{package}.strategies").StrategyRegistry
        classes = importlib.import_module(_FLAVOURS[package]).STRATEGIES
        added = []
        for name, cls in classes.items():
            entry = dict.get(registry, name) if isinstance(registry, dict) else None  # its .get raises
            if isinstance(entry, dict) and entry.get("strategy") is cls:
                continue
            registry.register(name, cls, description=STRATEGIES[name].description, override=True)
            added.append(name)
        return added


def _register_quietly(package: str) -> None:
    flavour = sys.modules.get(_FLAVOURS[package])
    if flavour is not None and getattr(flavour.__spec__, "_initializing", False):
        return  # that module imported Lightning itself and registers when it is done
    try:
        register(package)
    except Exception as exc:  # noqa: BLE001 - never break the user's import of Lightning
        warnings.warn(f"lightning_optim: could not register the 1-bit strategies in {package}: {exc!r}", stacklevel=2)


class _RegisteringLoader(importlib.abc.Loader):
    """Runs the real loader, then registers; puts the real loader back on the module."""

    def __init__(self, inner: Any, package: str) -> None:
        self._inner = inner
        self._package = package

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self._inner
        if module.__spec__ is not None:
            module.__spec__.loader = self._inner
        self._inner.exec_module(module)
        _register_quietly(self._package)

    def __getattr__(self, name: str) -> Any:  # get_source, get_resource_reader, is_package...
        return getattr(self._inner, name)


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of the watched Lightning packages."""

    def __init__(self) -> None:
        self._busy: set[str] = set()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in _FLAVOURS or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)  # the other finders (we return None while busy)
        except (ImportError, ValueError):
            spec = None
        finally:
            self._busy.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _RegisteringLoader(spec.loader, fullname)
        return spec


_finder: _AfterImportFinder | None = None


def install() -> None:
    """Register now where Lightning is imported, or right after its import otherwise (idempotent)."""
    global _finder
    with _lock:
        if _finder is None:
            _finder = _AfterImportFinder()
            sys.meta_path.insert(0, _finder)
        for package in _FLAVOURS:
            module = sys.modules.get(package)
            if module is not None and getattr(module.__spec__, "_initializing", False) is False:
                _register_quietly(package)
