"""Register the catalogue's strategy names in Lightning's strategy registries.

Lightning 2.x has no plugin discovery for strategies: a name is known to ``Trainer(strategy=...)`` only once
it is in ``StrategyRegistry``. So ``import lightning_optim`` calls :func:`register_installed`, which registers
the names in ``lightning.pytorch`` and in ``pytorch_lightning``, each where it is installed (importing it: the
price of ``Trainer(strategy="onebit_adam")`` working whatever order a script imports things in; without
Lightning installed nothing is imported and nothing happens). Registering is the registry's own public
``register``: no attribute of any Lightning module changes and no import hook is installed.

Names: the strategies of :mod:`lightning_optim.catalogue` (``onebit_adam``, ``zero_one_adam``,
``onebit_lamb``; the comm-hook ones ``powersgd``, ``topk``, ...), and the old names of
:data:`~lightning_optim.catalogue.STRATEGY_ALIASES` (``signsgd``: the same strategy after a FutureWarning). A
registration failure never breaks the user's import; it becomes one warning. :func:`register` does the work for
one package and can be called by hand.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

from lightning_optim.catalogue import STRATEGIES, STRATEGY_ALIASES, strategy_name

__all__ = ["register_installed", "register", "NAMES"]

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
        for old, new in STRATEGY_ALIASES.items():  # old names: the same class, after a FutureWarning
            factory = _renamed_factory(package, old)
            entry = dict.get(registry, old) if isinstance(registry, dict) else None
            if isinstance(entry, dict) and entry.get("strategy") is factory:
                continue
            registry.register(old, factory, description=f"deprecated name of {new!r}: {STRATEGIES[new].description}",
                              override=True)
            added.append(old)
        return added


_factories: dict[tuple[str, str], Callable[..., Any]] = {}


def _renamed_factory(package: str, old: str) -> Callable[..., Any]:
    """What the registry builds for an old name: the new name's class, after one FutureWarning (one function per
    package and name, so registering twice changes nothing)."""
    if (package, old) not in _factories:
        def build(**kwargs: Any) -> Any:
            new = strategy_name(old)  # warns
            return importlib.import_module(_FLAVOURS[package]).STRATEGIES[new](**kwargs)

        _factories[(package, old)] = build
    return _factories[(package, old)]


def _register_quietly(package: str) -> None:
    flavour = sys.modules.get(_FLAVOURS[package])
    if flavour is not None and getattr(flavour.__spec__, "_initializing", False):
        return  # that module imported Lightning itself and registers when it is done
    try:
        register(package)
    except Exception as exc:  # noqa: BLE001 - never break the user's import of Lightning
        warnings.warn(f"lightning_optim: could not register the 1-bit strategies in {package}: {exc!r}", stacklevel=2)


def register_installed() -> None:
    """Register the names in every installed Lightning package (idempotent)."""
    for package in _FLAVOURS:
        top_level = package.split(".", 1)[0]
        try:
            installed = importlib.util.find_spec(top_level) is not None
        except (ImportError, ValueError):
            installed = False
        if installed:
            _register_quietly(package)
