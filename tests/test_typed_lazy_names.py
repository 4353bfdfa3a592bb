"""The names a package loads on first use (PEP 562 ``__getattr__``) are what type checkers see as well: the package
imports each of them under ``if TYPE_CHECKING:`` from the module that defines it, and lists it in a static
``__all__`` (the package ships ``py.typed``, so its users' type checkers read these imports)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

# package -> (its mapping of lazy names, how a mapping value names the defining module)
LAZY = {
    "lightning_optim.distributed": ("_WHERE", lambda package, value: f"{package}.{value}"),
    "lightning_optim.data": ("_LIGHTNING_NAMES", lambda package, value: value),
    "lightning_optim.model": ("_LIGHTNING_NAMES", lambda package, value: value),
}


def _type_checking_imports(path: Path) -> dict[str, str]:
    """``{name: module}`` of the ``from module import name`` statements inside ``if TYPE_CHECKING:`` blocks."""
    found = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for statement in node.body:
                if isinstance(statement, ast.ImportFrom):
                    found.update({alias.asname or alias.name: statement.module for alias in statement.names})
    return found


@pytest.mark.parametrize("package_name", sorted(LAZY))
def test_every_lazy_name_is_imported_for_type_checkers(package_name):
    package = importlib.import_module(package_name)
    attribute, module_of = LAZY[package_name]
    lazy = getattr(package, attribute)
    typed = _type_checking_imports(Path(package.__file__))
    assert lazy, "no lazy names found: the mapping moved"
    assert typed == {name: module_of(package_name, value) for name, value in lazy.items()}
    assert set(lazy) <= set(package.__all__)
    for name, module in typed.items():  # the name resolves at run time to what the type checker was shown
        assert getattr(package, name) is getattr(importlib.import_module(module), name)
