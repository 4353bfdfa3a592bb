"""Importing lightning-optim changes nothing in other libraries: every module of torch, Lightning, transformers
and Accelerate keeps each attribute it had (same object), and no import hook is added to ``sys.meta_path``.

Swept over every module of ``lightning_optim`` and ``accel_plugins``, in a fresh interpreter that imported the
other libraries (and the torch module our PowerSGD hook builds on) first."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = r"""
import importlib, json, pkgutil, sys, types, warnings
warnings.simplefilter("ignore")
import torch, torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook
import lightning.pytorch, pytorch_lightning, transformers, accelerate, transformers.trainer

FOREIGN = ("torch", "lightning", "pytorch_lightning", "lightning_fabric", "transformers", "accelerate")

def snapshot():
    return {name: {key: id(value) for key, value in list(vars(module).items())}
            for name, module in list(sys.modules.items())
            if isinstance(module, types.ModuleType) and name.split(".")[0] in FOREIGN}

before, hooks = snapshot(), list(sys.meta_path)
kept = []  # keeps every object of `before` alive, so that an id seen again is the same object
for name in before:
    kept.extend(vars(sys.modules[name]).values())
imported = []
for package in ("lightning_optim", "accel_plugins"):
    root = importlib.import_module(package)
    imported.append(package)
    for info in pkgutil.walk_packages(root.__path__, package + "."):
        importlib.import_module(info.name)
        imported.append(info.name)
after = snapshot()
changes = []
for name, attributes in before.items():
    now = after[name]
    for key in attributes.keys() | now.keys():
        if attributes.get(key) == now.get(key):
            continue
        value = getattr(sys.modules[name], key, None)
        if key not in attributes and isinstance(value, types.ModuleType) and value.__name__ == f"{name}.{key}":
            continue  # the import system binds a newly imported submodule to its parent: no change of ours
        module = sys.modules[name]
        lazy = "__getattr__" in vars(module) or "__getattr__" in vars(type(module))
        own = str(getattr(value, "__module__", "")).split(".")[0] == name.split(".")[0]
        if key not in attributes and lazy and own:
            continue  # the library's lazy loader caching one of its own names (transformers.Trainer) on first use
        if key == "__warningregistry__":
            continue  # the warnings machinery's own record of a warning shown (and ignored) above
        changes.append(f"{name}.{key}")
print(json.dumps({"changes": sorted(changes), "hooks": [repr(h) for h in sys.meta_path if h not in hooks],
                  "imported": len(imported)}))
"""


def test_importing_every_module_changes_no_other_library():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["imported"] > 100  # the sweep reached every module, not the packages alone
    assert report["changes"] == [], report["changes"]
    assert report["hooks"] == [], report["hooks"]
