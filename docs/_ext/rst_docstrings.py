"""A griffe extension for the docs site: the docstrings' reStructuredText markup as Markdown.

The project's docstrings use Google-style sections (``Args:``) with reStructuredText inline markup:
``:math:`...``` and ``.. math::`` blocks, ``:class:``/``:func:``/``:meth:``/... roles and ``::`` literal
blocks. mkdocstrings renders docstrings as Markdown, so before griffe parses the sections this extension
rewrites, in every docstring of a loaded package:

- ``:math:`x``` into ``\\(x\\)`` and a ``.. math::`` block into a ``$$`` block (``aligned`` when its lines
  have ``&``, ``gathered`` when they only break with ``\\\\``), both rendered by pymdownx.arithmatex and MathJax;
- ``:class:`X``` and the other object roles into a link to X's entry in the reference when the site documents
  X (an optional mkdocs-autorefs reference: an object the site does not document stays code, without a
  warning); the role's target is resolved from the docstring's scope as Sphinx would (``~`` shows the last
  component, ``title <target>`` a title);
- a paragraph ending with ``::`` and its indented block into the paragraph and a fenced code block;
- simple tables (``=====`` borders) into Markdown tables, and entries indented under a heading line
  (``Shared keyword flags:``, the ``Aliases`` section) into a Markdown list; arguments grouped in one
  ``Args:`` entry (``a, b: ...``) into one entry each, as griffe's Google-style parser reads them.

It also shows what griffe's static analysis cannot see: names loaded on first access and classes built at
import time (see :class:`RstDocstrings`), and a class's docstring as Python has it where a decorator extended it.

mkdocs.yml loads it through the python handler's ``extensions`` option (``docs/_ext/rst_docstrings.py:RstDocstrings``);
tests/test_docs_site.py checks the conversions.
"""

from __future__ import annotations

import html
import re
import textwrap
from typing import Any

import griffe

_OBJECT_ROLES = ("class", "func", "meth", "attr", "mod", "data", "exc", "obj")
_ROLE = re.compile(r"(?<![\w\\]):(?:py:)?(?P<role>math|" + "|".join(_OBJECT_ROLES) + r"):`(?P<body>[^`]+)`")
_MATH_DIRECTIVE = re.compile(r"^(?P<indent>[ \t]*)\.\. math::[ \t]*(?P<rest>.*)$")
_TITLED_TARGET = re.compile(r"^(?P<title>.+?)\s*<(?P<target>[^<>]+)>$")
# Names resolved as written: the packages documented here and the libraries they build on.
_ABSOLUTE_ROOTS = ("lightning_optim", "accel_plugins", "torch", "lightning", "transformers", "accelerate")


def _indent_of(line: str) -> int:
    return len(line) - len(line.lstrip())


def _block_after(lines: list[str], start: int, indent: int) -> tuple[list[str], int]:
    """The lines of the block indented past ``indent`` from ``start`` on (blank lines inside kept, trailing
    ones dropped), and the index after it."""
    end = start
    while end < len(lines) and (not lines[end].strip() or _indent_of(lines[end]) > indent):
        end += 1
    while end > start and not lines[end - 1].strip():
        end -= 1
    return lines[start:end], end


def _math_block(body: str, indent: str) -> list[str]:
    """One ``$$`` block per equation (reST separates equations in a ``.. math::`` block by blank lines)."""
    out: list[str] = []
    for equation in re.split(r"\n[ \t]*\n", body.strip("\n")):
        equation = textwrap.dedent(equation).strip()
        if not equation:
            continue
        if "\\\\" in equation:
            env = "aligned" if "&" in equation else "gathered"
            equation = f"\\begin{{{env}}}\n{equation}\n\\end{{{env}}}"
        out += ["", f"{indent}$$", *(f"{indent}{line}" for line in equation.splitlines()), f"{indent}$$", ""]
    return out


def convert_blocks(text: str) -> str:
    """``.. math::`` directives and ``::`` literal blocks as Markdown blocks."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        directive = _MATH_DIRECTIVE.match(line)
        if directive:
            indent = directive["indent"]
            block, i = _block_after(lines, i + 1, len(indent))
            body = "\n".join([directive["rest"], *block]) if directive["rest"] else "\n".join(block)
            out += _math_block(body, indent)
            continue
        stripped = line.rstrip()
        if stripped.endswith("::") and not stripped.lstrip().startswith(".."):
            # The literal block: the next non-blank lines indented past this paragraph's first line.
            j = i + 1
            while j < len(lines) and not lines[j].strip():
                j += 1
            k = i
            while k > 0 and lines[k - 1].strip():
                k -= 1
            paragraph_indent = _indent_of(lines[k])
            if i + 1 < j < len(lines) and _indent_of(lines[j]) > paragraph_indent:
                block, end = _block_after(lines, j, paragraph_indent)
                # reST: "text::" reads "text:", "text ::" reads "text", a lone "::" nothing.
                head = stripped[:-2]
                if head.strip():
                    out.append(head.rstrip() if head.endswith(" ") else head + ":")
                fence = " " * paragraph_indent
                code = textwrap.dedent("\n".join(block)).splitlines()
                out += ["", f"{fence}```python", *(f"{fence}{c}" if c else "" for c in code), f"{fence}```", ""]
                i = end
                continue
        out.append(line)
        i += 1
    result = "\n".join(out)
    return re.sub(r"\n{3,}", "\n\n", result).strip("\n")


def _resolve(target: str, scope: Any) -> str | None:
    """The full path of ``target`` seen from the griffe object ``scope``, or None when unknown."""
    if target.split(".")[0] in _ABSOLUTE_ROOTS:
        return target
    if scope is None:
        return None
    head, _, rest = target.partition(".")
    try:
        resolved = scope.resolve(head)
    except (griffe.NameResolutionError, AttributeError, KeyError):
        return None
    return f"{resolved}.{rest}" if rest else resolved


def convert_roles(text: str, scope: Any = None) -> str:
    """Inline ``:math:`` and object roles as Markdown (see the module docstring)."""

    def replace(match: re.Match[str]) -> str:
        role, body = match["role"], match["body"]
        if role == "math":
            return f"\\({body.strip()}\\)"
        titled = _TITLED_TARGET.match(body)
        if titled:
            title, target = titled["title"], titled["target"]
        else:
            target = body.lstrip("~!")
            title = target.rsplit(".", 1)[-1] if body.startswith("~") else target
        target = target.strip().removesuffix("()").lstrip(".")
        path = _resolve(target, scope)
        code = f"<code>{html.escape(title)}</code>"
        if path is None:
            return code
        return f'<autoref identifier="{html.escape(path)}" optional>{code}</autoref>'

    return _ROLE.sub(replace, text)


_ARGS_SECTION = re.compile(r"^(?P<indent>[ \t]*)(?:Args|Arguments|Parameters|Params|Keyword Args|Keyword Arguments"
                           r"|Other Parameters):[ \t]*$")
# The colon that ends an entry's names: the first one followed by a space or the line's end, outside ``code``.
_NAMES_END = re.compile(r"^(?P<names>(?:[^:`]|``[^`]*``)*?):(?:[ \t]+|$)")


def split_args(text: str) -> str:
    """One entry per name in ``Args:`` sections.

    The docstrings group arguments that share a description (``foreach, kahan_sum: see BaseOptimizer``), at
    times over several lines; griffe's Google parser takes one name per entry, so each name gets its own entry
    with the group's description (and so its own type and default from the signature).
    """
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        out.append(lines[i])
        header = _ARGS_SECTION.match(lines[i])
        i += 1
        if not header:
            continue
        while i < len(lines) and not lines[i].strip():
            out.append(lines[i])
            i += 1
        if i == len(lines) or _indent_of(lines[i]) <= len(header["indent"]):
            continue
        entry_indent = _indent_of(lines[i])
        while i < len(lines) and lines[i].strip() and _indent_of(lines[i]) >= entry_indent:
            # one entry: its first line and the deeper continuation lines
            end = i + 1
            while end < len(lines) and lines[end].strip() and _indent_of(lines[end]) > entry_indent:
                end += 1
            entry = lines[i:end]
            i = end
            joined = entry[0].strip()
            used = 1
            while not _NAMES_END.match(joined) and used < len(entry):  # names wrapped onto the next lines
                joined += " " + entry[used].strip()
                used += 1
            match = _NAMES_END.match(joined)
            if match is None or "," not in match["names"]:
                out += entry
                continue
            names = [name.strip() for name in match["names"].split(",") if name.strip()]
            description = joined[match.end():]
            rest = entry[used:]
            pad = " " * entry_indent
            for name in names:
                out.append(f"{pad}{name}: {description}".rstrip())
                out += rest
    return "\n".join(out)


_GOOGLE_SECTION = re.compile(
    r"^[ \t]*(?:Args|Arguments|Params|Parameters|Keyword Args|Keyword Arguments|Other Args|Other Arguments"
    r"|Other Params|Other Parameters|Raises|Exceptions|Returns|Yields|Receives|Examples|Attributes|Functions"
    r"|Methods|Classes|Modules|Warns|Warnings):[ \t]*$"
)
# An entry of a list written as indented lines under a heading: ``name: ...``, ``a, b: ...`` or ````code`` ...``.
_ENTRY = re.compile(r"^(?:``[^`]+``|[\w*]+(?:, [\w*]+)*:)(?:\s|$)")


def convert_entry_lists(text: str) -> str:
    """A heading line ending with ``:`` and the entries indented under it (``Shared keyword flags:`` then
    ``weight_decay: ...`` lines; the ``Aliases`` section) as a Markdown list; Markdown would run them into
    one paragraph. Google sections (``Args:``, ...) are griffe's and stay as they are."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        out.append(line)
        i += 1
        stripped = line.rstrip()
        if not stripped.endswith(":") or stripped.endswith("::"):
            continue
        if _GOOGLE_SECTION.match(line):  # copy the section whole: its entries are griffe's to parse
            while i < len(lines) and (not lines[i].strip() or _indent_of(lines[i]) > _indent_of(line)):
                out.append(lines[i])
                i += 1
            continue
        if i == len(lines) or not lines[i].strip() or _indent_of(lines[i]) <= _indent_of(line):
            continue
        if not _ENTRY.match(lines[i].strip()):
            continue
        block, end = _block_after(lines, i, _indent_of(line))
        if any(b.strip().startswith(("$$", "```")) for b in block):
            continue
        base, pad = _indent_of(block[0]), " " * _indent_of(line)
        out.append("")
        for entry in block:
            if not entry.strip():
                continue
            if _indent_of(entry) <= base:
                out.append(f"{pad}- {entry.strip()}")
            else:
                out.append(f"{pad}    {entry.strip()}")
        out.append("")
        i = end
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out))


_TABLE_BORDER = re.compile(r"^(?P<indent>[ \t]*)=+(?: +=+)+[ \t]*$")


def _table_cells(line: str, starts: list[int]) -> list[str]:
    """A simple table row's cells: split where the border's columns start, or at runs of two or more spaces
    when a cell overflows its column (the same number of cells either way)."""
    by_gaps = re.split(r"\s{2,}", line.strip())
    if len(by_gaps) == len(starts):
        return by_gaps
    bounds = [*starts[1:], None]
    return [line[start:end].strip() for start, end in zip(starts, bounds)]


def convert_tables(text: str) -> str:
    """reST simple tables (``=====  =====`` borders) as Markdown tables; a row whose first cell is empty
    continues the row above. A table without a header row gets an empty one (Markdown needs one)."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        border = _TABLE_BORDER.match(lines[i])
        if not border:
            out.append(lines[i])
            i += 1
            continue
        starts = [m.start() for m in re.finditer(r"=+", lines[i])]
        borders, rows, j = [i], [], i + 1
        while j < len(lines) and len(borders) < 3:
            if _TABLE_BORDER.match(lines[j]):
                borders.append(j)
                if j + 1 >= len(lines) or not lines[j + 1].strip():
                    break
            elif lines[j].strip():
                rows.append((j, _table_cells(lines[j], starts)))
            else:
                break
            j += 1
        if len(borders) < 2:
            out.append(lines[i])
            i += 1
            continue
        merged: list[tuple[int, list[str]]] = []
        for index, cells in rows:
            if merged and not cells[0] and (len(borders) == 2 or index > borders[1]):
                merged[-1] = (merged[-1][0], [f"{a} {b}".strip() for a, b in zip(merged[-1][1], cells)])
            else:
                merged.append((index, cells))
        if len(borders) == 3:
            header = [cells for index, cells in merged if index < borders[1]]
            body = [cells for index, cells in merged if index > borders[1]]
            head = header[0] if header else [""] * len(starts)
        else:
            head, body = [""] * len(starts), [cells for _, cells in merged]
        pad = border["indent"]

        def row(cells: list[str], pad: str = pad) -> str:
            return pad + "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"

        out += ["", row(head), pad + "|" + "|".join(" --- " for _ in starts) + "|", *(row(c) for c in body), ""]
        i = borders[-1] + 1
    return "\n".join(out)


def convert(text: str, scope: Any = None) -> str:
    """A docstring's reStructuredText markup as Markdown."""
    text = convert_roles(convert_entry_lists(convert_tables(convert_blocks(split_args(text)))), scope)
    return re.sub(r"\n{3,}", "\n\n", text)


def _static(loader: Any, path: str) -> Any:
    try:
        return loader.modules_collection[path]
    except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None


def _runtime_path(obj: Any) -> str | None:
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    return f"{module}.{qualname}" if module and qualname else None


class RstDocstrings(griffe.Extension):
    """For each package griffe loads: its lazily loaded public names, then every docstring as Markdown.

    Lazily loaded names (PEP 562 ``__getattr__``: ``lightning_optim.lightning``, ``accel_plugins``) and classes
    built at import time (the Lightning strategies, each a mixin on Lightning's ``DDPStrategy``) are invisible to
    griffe's static analysis. For every name of a module's ``__all__`` that griffe did not find, the module is
    imported (it needs its extra, as the docs build has) and the name becomes an alias to where its object is
    defined; a class built at import time becomes a class of that name with the docstring, ``__init__`` and
    public methods of the first class of its MRO defined in the source, and its public bases.
    """

    def on_package(self, *, pkg: griffe.Module, loader: Any = None, **kwargs: Any) -> None:
        self._runtime_docstrings(pkg)
        self._convert_tree(pkg, seen=set())
        if loader is not None:
            self._add_lazy_names(pkg, loader)

    def _runtime_docstrings(self, pkg: Any) -> None:
        """A class's docstring as Python has it (``help()``), where that differs from the source's: the
        ``Aliases`` section a decorator appends, a ``__doc__`` assigned in the class body."""
        import importlib
        import inspect

        for module in self._modules(pkg):
            if module.name == "__main__":
                continue
            try:
                runtime = importlib.import_module(module.path)
            except ImportError:  # its optional framework is not installed (pytorch_lightning)
                continue
            for member in module.members.values():
                if member.is_alias or not member.is_class:
                    continue
                cls = runtime.__dict__.get(member.name)
                doc = inspect.cleandoc(cls.__doc__) if isinstance(cls, type) and cls.__doc__ else None
                if doc and (member.docstring is None or member.docstring.value != doc):
                    lineno = member.docstring.lineno if member.docstring is not None else member.lineno
                    member.docstring = griffe.Docstring(doc, lineno=lineno, parent=member)

    def _convert_tree(self, obj: Any, seen: set[str]) -> None:
        if obj.path in seen:
            return
        seen.add(obj.path)
        if obj.docstring is not None:
            scope = obj if obj.is_class or obj.is_module else obj.parent
            obj.docstring.value = convert(obj.docstring.value, scope)
        for member in obj.members.values():
            if not member.is_alias:
                self._convert_tree(member, seen)

    def _modules(self, module: Any) -> list[Any]:
        """``module`` and its submodules, deepest first (a package's names may come from its submodules)."""
        found: list[Any] = []
        for member in module.members.values():
            if not member.is_alias and member.is_module:
                found += self._modules(member)
        return [*found, module]

    def _add_lazy_names(self, pkg: Any, loader: Any) -> None:
        import importlib
        import inspect

        built: dict[int, str] = {}  # id of a class built at import time -> the path of its griffe class
        for module in self._modules(pkg):
            exports = module.exports if isinstance(module.exports, (list, tuple, set)) else ()
            missing = [name for name in exports if isinstance(name, str) and name not in module.members]
            if not missing:
                continue
            try:
                runtime = importlib.import_module(module.path)
            except ImportError:
                continue  # its extra is not installed: mkdocstrings reports the names it cannot find
            for name in missing:
                obj = getattr(runtime, name, None)
                if obj is None:
                    continue
                home = _runtime_path(obj)
                if id(obj) in built:
                    module.set_member(name, griffe.Alias(name, built[id(obj)], parent=module))
                elif home and _static(loader, home) is not None:
                    module.set_member(name, griffe.Alias(name, home, parent=module))
                elif inspect.isclass(obj):
                    cls = self._built_class(name, obj, module, loader)
                    if cls is not None:
                        module.set_member(name, cls)
                        built[id(obj)] = cls.path

    def _built_class(self, name: str, obj: type, module: Any, loader: Any) -> Any:
        """A griffe class for ``obj``, a class made at import time (see the class docstring)."""
        source = next((c for c in obj.__mro__[1:] if _static(loader, _runtime_path(c) or "") is not None), None)
        if source is None:
            return None
        static = _static(loader, _runtime_path(source) or "")
        bases = [path for base in obj.__bases__ if (path := _runtime_path(base)) and not base.__name__.startswith("_")]
        cls = griffe.Class(name, lineno=static.lineno, endlineno=static.endlineno, bases=bases, parent=module)
        if static.docstring is not None:
            cls.docstring = griffe.Docstring(static.docstring.value, lineno=static.docstring.lineno, parent=cls)
        for member in ["__init__", *(m for m in dir(obj) if not m.startswith("_"))]:
            owner = next((c for c in obj.__mro__ if member in c.__dict__), None)
            owner_path = _runtime_path(owner) if owner is not None else None
            if owner_path and owner is not obj and _static(loader, f"{owner_path}.{member}") is not None:
                cls.set_member(member, griffe.Alias(member, f"{owner_path}.{member}", parent=cls))
        return cls
