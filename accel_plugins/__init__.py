"""Adapters for Hugging Face Accelerate (``accelerate.py``: ``enable_onebit``, ``to_onebit_optimizer``;
``master_weights.py``: ``enable_master_weights``; ``release.py``: ``enable_gradient_release``;
``diloco.py``: ``enable_diloco``) and the Hugging Face Trainer (``hf.py``: ``from accel_plugins.hf import
Trainer, TrainingArguments, DiLoCoCallback``).

Install their dependencies with ``pip install "lightning-optim[hf]"``: importing this package without them
raises an ``ImportError`` naming the extra. Importing it does not import Accelerate or transformers; the names
below load their module on first access.
"""

from __future__ import annotations

import importlib
from typing import Any

from lightning_optim.extras import require

require("hf", "accel_plugins (the Accelerate and HF Trainer adapters)")

__all__ = ["enable_onebit", "to_onebit_optimizer", "OnebitHandle", "enable_master_weights", "MasterWeightsHandle",
           "enable_gradient_release", "GradientReleaseHandle", "enable_diloco", "DiLoCoHandle"]

_WHERE = {"enable_onebit": "accelerate", "to_onebit_optimizer": "accelerate", "OnebitHandle": "accelerate",
          "enable_master_weights": "master_weights", "MasterWeightsHandle": "master_weights",
          "enable_gradient_release": "release", "GradientReleaseHandle": "release",
          "enable_diloco": "diloco", "DiLoCoHandle": "diloco"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
