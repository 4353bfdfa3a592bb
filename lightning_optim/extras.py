"""The optional parts of lightning-optim and the extra that installs each.

``pip install lightning-optim`` brings torch alone: the optimizers, the 1-bit family, the compressors, DiLoCo
and the precision tools need nothing else. Each adapter needs its framework, installed by an extra:

=============  =====================================================  =====================================
extra          what it installs                                       what needs it
=============  =====================================================  =====================================
``lightning``  Lightning                                              ``lightning_optim.lightning``, the
                                                                      Lightning names of ``.data``/``.model``
``train``      Lightning, Hydra, matplotlib                           the main job (``lightning_optim.train``)
``hf``         transformers, Accelerate                               ``accel_plugins``
``dev``        all of the above and the test and lint tools           the tests
=============  =====================================================  =====================================

:func:`require` raises an ``ImportError`` naming the extra where a framework is missing, before the adapter
imports it (a plain ``No module named 'hydra'`` would not say how to get it).
"""

from __future__ import annotations

import importlib.util

__all__ = ["EXTRAS", "require", "installed"]

# extra -> the import names it provides; each entry a tuple of alternatives (any one of them will do)
EXTRAS: dict[str, tuple[tuple[str, ...], ...]] = {
    "lightning": (("lightning", "pytorch_lightning"),),
    "train": (("lightning",), ("hydra",), ("omegaconf",), ("matplotlib",)),
    "hf": (("transformers",), ("accelerate",)),
}


def installed(name: str) -> bool:
    """Whether the top-level module ``name`` can be imported (found, not imported)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def require(extra: str, feature: str) -> None:
    """Raise ``ImportError`` naming ``extra`` if a module it installs is missing; ``feature`` says who asks."""
    if extra not in EXTRAS:
        raise ValueError(f"extra must be one of {sorted(EXTRAS)}, got {extra!r}")
    missing = [alternatives[0] for alternatives in EXTRAS[extra] if not any(map(installed, alternatives))]
    if missing:
        raise ImportError(f"{feature} needs {', '.join(missing)} (not installed): "
                          f"pip install 'lightning-optim[{extra}]'", name=missing[0])
