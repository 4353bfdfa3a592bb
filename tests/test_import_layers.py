"""The house's floors: no import circle between modules (top-level, function-level and TYPE_CHECKING
imports alike; package ``__init__`` re-exports aside), and no arrow from a lower floor to a higher one
(catalogue, extras, ops < optim < comm < precision, distributed < onebit < lightning < the job and the adapters).

Read from the sources with ``ast`` (nothing imported), over lightning_optim/ and accel_plugins/."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("lightning_optim", "accel_plugins")
# catalogue.py names classes by import path only (a leaf anyone may read); renames.py (old names, ignored
# arguments) and extras.py (which extra installs which framework) import the standard library only
FLOORS = {"catalogue": 0, "renames": 0, "extras": 0, "ops": 0, "optim": 1, "comm": 2, "precision": 3, "distributed": 3, "onebit": 4,
          "fault_tolerance": 4,
          "lightning": 5}
TOP = 6  # the training job, config checks, the root package and accel_plugins


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


MODULES = _modules()
INITS = {name for name, path in MODULES.items() if path.name == "__init__.py"}


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(name: str) -> set[str]:
    """The modules of ours that ``name`` imports anywhere in its source."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            # `from pkg import sub`: the submodule when it is one, else the package
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        out.update(t for t in map(_resolve, targets) if t is not None and t != name)
    return out


GRAPH = {name: _imports(name) for name in MODULES}


def _floor(name: str) -> int:
    parts = name.split(".")
    if parts[0] != "lightning_optim" or len(parts) < 2:
        return TOP
    return FLOORS.get(parts[1], TOP)


def test_no_import_circles():
    edges = {m: {t for t in ts if t not in INITS} for m, ts in GRAPH.items() if m not in INITS}
    circles, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                circles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for start in sorted(edges):
        if start not in state:
            visit(start, [start])
    assert circles == []


def test_no_arrow_up_the_floors():
    up = [f"{m} ({_floor(m)}) imports {t} ({_floor(t)})" for m, ts in GRAPH.items() for t in ts
          if _floor(t) > _floor(m) and not (m == "lightning_optim" or m in INITS and t.startswith(m + "."))]
    assert up == []


def test_the_scan_sees_imports():
    """Negative control: known arrows are found (a scan that finds nothing proves nothing)."""
    assert "lightning_optim.optim.base" in GRAPH["lightning_optim.onebit.base"]
    assert "lightning_optim.optim.release" in GRAPH["lightning_optim.comm.ddp_hooks.release"]
    assert _floor("lightning_optim.optim.base") < _floor("lightning_optim.comm.ddp_hooks.release")
