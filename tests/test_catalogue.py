"""The one catalogue of names (lightning_optim.catalogue) against everything that names optimizers and
strategies: the top-level exports (plain imports, ``__all__``), the Lightning registries (old names too),
the strategies' optimizer classes, the Accelerate helper, the HF names and the specs of the generic optimizer
tests. The Hydra groups are checked against it in tests/test_configs.py."""

from __future__ import annotations

import ast
import importlib
import inspect
import warnings
from pathlib import Path

import pytest
import torch

import lightning_optim
from lightning_optim.catalogue import (
    DISTRIBUTED,
    OPTIMIZER_ALIASES,
    OPTIMIZERS,
    STRATEGIES,
    STRATEGY_ALIASES,
    optimizer_class,
)
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


def test_the_exports_are_plain_imports_and_all_is_the_catalogue():
    """``__all__`` is a plain list: the catalogue's classes plus the named helpers; each optimizer is a plain
    ``from ... import`` of the package, naming the very class the catalogue points to; the strategies (they need
    Lightning) load on first access."""
    tree = ast.parse(Path(lightning_optim.__file__).read_text())
    (listed,) = [node.value for node in tree.body if isinstance(node, ast.Assign)
                 and any(getattr(t, "id", "") == "__all__" for t in node.targets)]
    assert isinstance(listed, ast.List) and all(isinstance(e, ast.Constant) for e in listed.elts)
    assert [e.value for e in listed.elts] == lightning_optim.__all__
    assert not any(isinstance(node, ast.If) for node in tree.body if "TYPE_CHECKING" in ast.dump(node))
    assert "globals()" not in Path(lightning_optim.__file__).read_text()
    helpers = {"DynamicLossScaler", "FP16Optimizer", "FlatParameters", "MasterWeights", "flatten_parameters",
               "prepare_for_gradient_release", "remove_gradient_release"}
    catalogue = {e.export for table in (OPTIMIZERS, DISTRIBUTED, STRATEGIES) for e in table.values()}
    assert len(lightning_optim.__all__) == len(set(lightning_optim.__all__))
    assert set(lightning_optim.__all__) == catalogue | helpers
    imported = {alias.asname or alias.name: node.module for node in tree.body if isinstance(node, ast.ImportFrom)
                for alias in node.names}
    for table in (OPTIMIZERS, DISTRIBUTED):
        for entry in table.values():
            assert entry.export in imported, f"{entry.export} is not a plain import of lightning_optim/__init__.py"
            assert getattr(importlib.import_module(imported[entry.export]), entry.export) is entry.cls
    for entry in STRATEGIES.values():
        assert entry.export not in imported and entry.export in dir(lightning_optim)


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


@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
def test_an_old_strategy_name_builds_the_new_names_class_with_one_warning(package):
    """``Trainer(strategy="signsgd")`` asks the registry for the old name: the new name's class comes back,
    after one FutureWarning naming both; nothing else warns (a name not renamed does not)."""
    pytest.importorskip(package)
    registry = importlib.import_module(f"{package}.strategies").StrategyRegistry
    assert STRATEGY_ALIASES and not set(STRATEGY_ALIASES) & set(STRATEGIES)
    for old, new in STRATEGY_ALIASES.items():
        assert new in STRATEGIES and old in registry.available_strategies()
        with pytest.warns(FutureWarning) as record:
            strategy = registry.get(old)
        assert len(record) == 1 and f"{old!r}" in str(record[0].message) and f"{new!r}" in str(record[0].message)
        assert type(strategy) is registry[new]["strategy"]
        assert "lightning_optim" not in record[0].filename  # it points at the caller, not at our factory
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert type(registry.get(new)) is type(strategy)


def test_an_old_optimizer_name_resolves_with_one_warning():
    assert OPTIMIZER_ALIASES and not set(OPTIMIZER_ALIASES) & set(OPTIMIZERS)
    for old, new in OPTIMIZER_ALIASES.items():
        with pytest.warns(FutureWarning, match=f"'{old}' is a deprecated name; use '{new}'") as record:
            assert optimizer_class(old) is OPTIMIZERS[new].cls
        assert len(record) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert optimizer_class("sign_sgd") is lightning_optim.SignSGD


def test_every_optimizer_has_a_spec_for_the_generic_tests():
    """tests/optim/specs.py drives the tests every optimizer must pass (foreach, gradient release, reload, Kahan,
    torch compatibility): each optimizer of the catalogue has its entry there, the 1-bit ones aside (they have
    suites of their own in tests/onebit)."""
    from tests.optim.specs import SPECS

    names = [spec.name for spec in SPECS]
    assert len(names) == len(set(names))
    assert sorted(names) == sorted(e.export for e in OPTIMIZERS.values() if not e.onebit)
