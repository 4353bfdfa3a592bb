"""The docs site's API reference covers the public API, and its docstring converter works; without mkdocs.

Every name of the public modules' ``__all__`` must appear in a ``::: path.Name`` directive of some page of
docs/reference/ (a new class cannot be left out of the reference), and every directive must name a module of
the repository that defines or exports that name (or a module, whose docstring introduces a section).
``__all__`` and the names are read from the sources (ast), so the test imports neither the packages nor their
extras. ``mkdocs build --strict`` (.ci/run) renders the pages.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "docs" / "reference"
# The modules whose __all__ is the public API the reference documents.
PUBLIC_MODULES = [
    "lightning_optim",
    "lightning_optim.optim",
    "lightning_optim.onebit",
    "lightning_optim.distributed",
    "lightning_optim.fault_tolerance",
    "lightning_optim.comm",
    "lightning_optim.comm.compressors",
    "lightning_optim.comm.ddp_hooks",
    "lightning_optim.precision",
    "lightning_optim.lightning",
    "accel_plugins",
    "accel_plugins.hf",
]
_DIRECTIVE = re.compile(r"^:::[ \t]+(?P<path>[\w.]+)[ \t]*$", re.MULTILINE)


def _source(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for path in (base / "__init__.py", base.with_suffix(".py")):
        if path.is_file():
            return path
    return None


def _names(module: str) -> tuple[list[str], set[str]]:
    """(``__all__``, every name the module binds or exports) from its source."""
    tree = ast.parse(_source(module).read_text())  # type: ignore[union-attr]
    exported: list[str] = []
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    bound.add(target.id)
                    if target.id == "__all__" and isinstance(node.value, ast.List | ast.Tuple):
                        exported = [ast.literal_eval(element) for element in node.value.elts]
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.ImportFrom | ast.Import):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return exported, bound | set(exported)


def _directives() -> dict[str, str]:
    """``{directive path: page}`` over the reference pages."""
    found: dict[str, str] = {}
    for page in sorted(REFERENCE.glob("*.md")):
        for match in _DIRECTIVE.finditer(page.read_text()):
            found[match["path"]] = page.name
    return found


def test_every_public_name_is_in_the_reference() -> None:
    directives = _directives()
    by_name: dict[str, list[str]] = {}
    for path in directives:
        by_name.setdefault(path.rsplit(".", 1)[-1], []).append(path)
    missing = []
    for module in PUBLIC_MODULES:
        exported, _ = _names(module)
        assert exported, f"{module}: no literal __all__ found in {_source(module)}"
        package = module.split(".")[0]
        for name in exported:
            if not any(path.split(".")[0] == package for path in by_name.get(name, [])):
                missing.append(f"{module}.{name}")
    assert not missing, (
        f"public names with no '::: path' entry in docs/reference/*.md (add one to the family's page): {missing}"
    )


def test_every_directive_names_a_module_of_the_repository() -> None:
    directives = _directives()
    assert directives, "no '::: path' entries in docs/reference/*.md"
    wrong = []
    for path, page in directives.items():
        if _source(path) is not None:  # a module: its docstring introduces a section
            continue
        module, _, name = path.rpartition(".")
        if _source(module) is None or name not in _names(module)[1]:
            wrong.append(f"{page}: {path}")
    assert not wrong, f"'::: path' entries whose module does not define or export the name: {wrong}"


def test_every_reference_page_is_in_the_nav() -> None:
    config = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(f"reference/{page.name}" for page in REFERENCE.glob("*.md"))
    assert pages
    assert [page for page in pages if page not in config] == []


@pytest.fixture(scope="module")
def converter() -> ModuleType:
    pytest.importorskip("griffe")  # the docs extra's (mkdocstrings-python's) docstring loader
    spec = importlib.util.spec_from_file_location("rst_docstrings", ROOT / "docs" / "_ext" / "rst_docstrings.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_math_becomes_arithmatex_markup(converter: ModuleType) -> None:
    text = "At step :math:`t`:\n\n.. math::\n    m &\\leftarrow g \\\\\n    v &\\leftarrow g^2\n\n    x = 1\n\nwith b."
    assert converter.convert(text) == (
        "At step \\(t\\):\n\n$$\n\\begin{aligned}\nm &\\leftarrow g \\\\\nv &\\leftarrow g^2\n\\end{aligned}\n$$"
        "\n\n$$\nx = 1\n$$\n\nwith b."
    )


def test_object_roles_become_optional_cross_references(converter: ModuleType) -> None:
    text = ":class:`~lightning_optim.onebit.OnebitAdam`, :func:`all <lightning_optim.comm.allreduce_mean>`"
    assert converter.convert(text) == (
        '<autoref identifier="lightning_optim.onebit.OnebitAdam" optional><code>OnebitAdam</code></autoref>, '
        '<autoref identifier="lightning_optim.comm.allreduce_mean" optional><code>all</code></autoref>'
    )
    assert converter.convert(":meth:`step`") == "<code>step</code>"  # no scope to resolve it in: stays code


def test_literal_blocks_and_grouped_arguments(converter: ModuleType) -> None:
    assert converter.convert("Run it::\n\n    a = 1\n\nDone.") == "Run it:\n\n```python\na = 1\n```\n\nDone."
    text = "Args:\n    lr, betas,\n        eps: as Adam\n        (defaults).\n    other: x"
    assert converter.convert(text) == (
        "Args:\n    lr: as Adam\n        (defaults).\n    betas: as Adam\n        (defaults).\n"
        "    eps: as Adam\n        (defaults).\n    other: x"
    )
