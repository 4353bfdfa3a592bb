"""The one catalogue of names (lightning_optim.catalogue) against everything that names optimizers and
strategies: the top-level exports (runtime and the type-checking imports), the Lightning registries,
the strategies' optimizer classes, the Accelerate helper and the HF names. The Hydra groups are
checked against it in tests/test_configs.py."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest
import torch

import lightning_optim
from lightning_optim.catalogue import DISTRIBUTED, OPTIMIZERS, STRATEGIES, optimizer_class
from lightning_optim.onebit import OnebitOptimizer


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_optimizer_is_exported_at_the_top_level(name):
    entry = OPTIMIZERS[name]
    assert inspect.isclass(entry.cls) and issubclass(entry.cls, torch.optim.Optimizer)
    assert getattr(lightning_optim, entry.export) is entry.cls and entry.export in lightning_optim.__all__
    assert entry.onebit == issubclass(entry.cls, OnebitOptimizer)
    assert optimizer_class(name) is entry.cls


@pytest.mark.parametrize("name", sorted(DISTRIBUTED))
def test_every_distributed_optimizer_is_exported_at_the_top_level(name):
    entry = DISTRIBUTED[name]
    assert inspect.isclass(entry.cls) and issubclass(entry.cls, torch.optim.Optimizer)
    assert getattr(lightning_optim, entry.export) is entry.cls and entry.export in lightning_optim.__all__
    assert name not in OPTIMIZERS and not entry.onebit


def test_no_optimizer_is_exported_outside_the_catalogue():
    exported = {n for n in lightning_optim.__all__ if n not in {e.export for e in STRATEGIES.values()}}
    optimizers = {n for n in exported if inspect.isclass(getattr(lightning_optim, n))
                  and issubclass(getattr(lightning_optim, n), torch.optim.Optimizer)}
    assert optimizers == {e.export for e in OPTIMIZERS.values()} | {e.export for e in DISTRIBUTED.values()}


def test_the_type_checking_imports_name_the_same_classes():
    tree = ast.parse(Path(lightning_optim.__file__).read_text())
    block = next(node for node in tree.body if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING")
    imported = {(node.module, alias.name) for node in block.body for alias in node.names}
    for module, name in imported:
        assert getattr(importlib.import_module(module), name) is getattr(lightning_optim, name)
    expected = {e.export for table in (OPTIMIZERS, DISTRIBUTED, STRATEGIES) for e in table.values()}
    assert {name for _, name in imported} == expected


def test_an_unknown_name_lists_the_names():
    with pytest.raises(ValueError, match="'adamz' is not one of lightning_optim's: adam, adamw"):
        optimizer_class("adamz")


@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
def test_every_strategy_is_registered_with_its_catalogue_optimizer(package):
    pytest.importorskip(package)
    registry = importlib.import_module(f"{package}.strategies").StrategyRegistry
    flavour = importlib.import_module("lightning_optim.lightning.strategies" if package == "lightning.pytorch"
                                      else "lightning_optim.lightning.pl_strategies")
    for name, entry in STRATEGIES.items():
        cls = registry[name]["strategy"]
        assert cls is getattr(flavour, entry.export) and registry[name]["description"] == entry.description
        if entry.optimizer is not None:  # a 1-bit strategy: it converts to that optimizer
            assert cls.optimizer_class is OPTIMIZERS[entry.optimizer].cls and OPTIMIZERS[entry.optimizer].onebit
    if package == "lightning.pytorch":
        for entry in STRATEGIES.values():
            assert getattr(lightning_optim, entry.export) is getattr(flavour, entry.export)


def test_the_integrations_read_the_catalogue():
    pytest.importorskip("accelerate")
    from accel_plugins.accelerate import ONEBIT_OPTIMIZERS

    assert ONEBIT_OPTIMIZERS == {n: e.cls for n, e in OPTIMIZERS.items() if e.onebit}
    pytest.importorskip("transformers")
    from accel_plugins.hf import OPTIM_NAMES

    assert set(OPTIM_NAMES) == set(OPTIMIZERS)
