"""Every Python block of the user docs runs, and every main-job command line in them composes and checks.

The pages: README.md, CONTRIBUTING.md and docs/**/*.md. Each ```python block is one test (its id: page and line),
run as its own script, ``python docs_block.py`` in a fresh temporary working directory (what it writes, say the
HF Trainer's ``out/``, lands there), in a process of multiprocessing's fork server (``tests.distributed.run_script``:
torch, lightning-optim and Lightning imported once, so a block costs its own work, not an interpreter's
start-up), on the CPU alone (``CUDA_VISIBLE_DEVICES`` empty) with one intra-op thread. It must exit 0. The
script has the block's lines at the page's line numbers, so a traceback's line is the page's.

A block that cannot run on one CPU in a few seconds (several processes, a GPU, a fragment of a larger script)
is marked on the line directly before its fence::

    <!-- docs-test: skip (needs 2 processes: torchrun --nproc_per_node 2) -->

It is still collected: the reason must be non-empty, the page must say something before it (the comment is
invisible in the rendered page: the sentence before the block says why it does not run alone), the block must
compile, and every name it imports must exist (one run checks the imports of all marked blocks). A
marker that is not directly before a Python block fails the page.

Bash blocks are not run; their ``python -m lightning_optim.train <overrides>`` lines are composed with Hydra
and passed to the job's own up-front check (``check_config``, as tests/test_config_errors.py does), so an
option a page names that the configs lost (or a value they now refuse) fails here.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.distributed import run_script

ROOT = Path(__file__).resolve().parent.parent
BLOCK_TIMEOUT_S = 120
SCRIPT = "docs_block.py"  # the file each block is written to

_FENCE = re.compile(r"^(?P<indent>[ ]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`]*)$")
_MARKER = re.compile(r"^[ ]*<!--[ \t]*docs-test:[ \t]*skip[ \t]*\((?P<reason>.*)\)[ \t]*-->[ \t]*$")
_ANY_MARKER = re.compile(r"^[ ]*<!--.*docs-test")
_PYTHON = {"python", "py", "python3"}
_SHELL = {"bash", "sh", "shell"}


def pages() -> list[Path]:
    found = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [page for page in found if page.is_file()]


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # 1-based line of the opening fence
    language: str
    code: str  # dedented to the fence's indent
    skip: str | None  # the marker's reason ("" for an empty one); None: no marker
    said_before: bool  # the nearest non-blank line before the marker is prose

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


@dataclass(frozen=True)
class PageProblem:
    page: str
    line: int
    what: str


def parse(page: Path) -> tuple[list[Block], list[PageProblem]]:
    """The fenced blocks of a page, and markers that are misplaced (not directly before a Python fence)."""
    name = page.relative_to(ROOT).as_posix()
    lines = page.read_text().splitlines()
    blocks: list[Block] = []
    problems: list[PageProblem] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        opening = _FENCE.match(line)
        if opening is None:
            if _ANY_MARKER.match(line) and not (_MARKER.match(line) and _opens_python(lines, i + 1)):
                what = "a docs-test marker is '<!-- docs-test: skip (reason) -->' directly before a ```python fence"
                problems.append(PageProblem(name, i + 1, what))
            i += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        language = _language(opening["info"])
        body, j = [], i + 1
        while j < len(lines) and not re.match(rf"^[ ]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$", lines[j]):
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j].lstrip())
            j += 1
        skip, said_before = None, True
        marker = _MARKER.match(lines[i - 1]) if i > 0 else None
        if marker is not None:
            skip = marker["reason"].strip()
            before = [text.strip() for text in lines[: i - 1] if text.strip()]
            said_before = bool(before) and not re.match(r"^(`{3}|~{3}|#|<!--|\|)", before[-1])
        blocks.append(Block(name, i + 1, language, "\n".join(body) + "\n", skip, said_before))
        i = j + 1
    return blocks, problems


def _language(info: str) -> str:
    """A fence's language: ``python`` of ``python``, ``{.python}`` or ``python title="x.py"``."""
    words = info.strip().strip("{}").lstrip(".").split()
    return words[0].lower() if words else ""


def _opens_python(lines: list[str], i: int) -> bool:
    opening = _FENCE.match(lines[i]) if i < len(lines) else None
    return opening is not None and _language(opening["info"]) in _PYTHON


_PARSED = {page: parse(page) for page in pages()}
PYTHON_BLOCKS = [block for blocks, _ in _PARSED.values() for block in blocks if block.language in _PYTHON]
MARKED = [block for block in PYTHON_BLOCKS if block.skip is not None]


def test_the_pages_have_python_blocks_and_well_placed_markers():
    assert len(PYTHON_BLOCKS) >= 20, [page.name for page in _PARSED]  # the parser found the blocks
    problems = [f"{p.page}:{p.line}: {p.what}" for _, found in _PARSED.values() for p in found]
    assert not problems, problems


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=lambda block: block.id)
def test_python_block(block: Block, tmp_path: Path, marked_imports: dict[str, str]):
    compile("\n" * (block.line) + block.code, f"{block.page}", "exec")  # a syntax error names the page's line
    if block.skip is not None:
        assert block.skip, f"{block.id}: the skip marker gives no reason"
        assert block.said_before, (
            f"{block.id}: the page says nothing before a block it marks as not run alone; say why in a sentence "
            f"there (the marker is invisible in the rendered page)")
        assert not marked_imports.get(block.id), f"{block.id}: its imports fail: {marked_imports[block.id]}"
        pytest.skip(f"not run: {block.skip}")
    (tmp_path / SCRIPT).write_text("\n" * block.line + block.code)  # the page's line numbers
    run = run_script(tmp_path / SCRIPT, cwd=tmp_path, env=_block_environment(), timeout=BLOCK_TIMEOUT_S)
    assert run.returncode == 0, (
        f"{block.id} failed (exit {run.returncode}; the traceback's line numbers are the page's):\n"
        f"{run.stdout[-2000:]}\n{run.stderr[-6000:]}")


def _block_environment() -> dict[str, str]:
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}


_IMPORT_PROBE = '''
import importlib, json, sys
checks = json.load(open("checks.json"))
failures = {}
for block_id, imports in checks.items():
    for module, names in imports:
        try:
            imported = importlib.import_module(module)
            missing = [name for name in names if name != "*" and not hasattr(imported, name)
                       and importlib.util.find_spec(f"{module}.{name}") is None]
        except Exception as error:
            failures[block_id] = f"import {module}: {type(error).__name__}: {error}"
            break
        if missing:
            failures[block_id] = f"from {module} import {', '.join(missing)}: not there"
            break
print(json.dumps(failures))
'''


@pytest.fixture(scope="module")
def marked_imports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """``{block id: what failed}`` for the marked blocks whose imports fail, from one run that imports every module
    (and looks up every name) the marked blocks import."""
    checks: dict[str, list[tuple[str, list[str]]]] = {}
    for block in MARKED:
        imports = []
        for node in ast.walk(ast.parse(block.code)):
            if isinstance(node, ast.Import):
                imports += [(alias.name, []) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imports.append((node.module, [alias.name for alias in node.names]))
        checks[block.id] = imports
    folder = tmp_path_factory.mktemp("docs_imports")
    (folder / "docs_imports.py").write_text(_IMPORT_PROBE)
    (folder / "checks.json").write_text(json.dumps(checks))
    run = run_script(folder / "docs_imports.py", cwd=folder, env=_block_environment(), timeout=BLOCK_TIMEOUT_S)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.splitlines()[-1])


# ------------------------------------------------------------------------------------- the job's commands
@dataclass(frozen=True)
class Command:
    page: str
    line: int
    overrides: tuple[str, ...]

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def job_commands() -> list[Command]:
    """The ``python -m lightning_optim.train <overrides>`` lines of the shell blocks that name overrides only
    (no ``--cfg``, ``--config-dir``, ``-m`` sweeps or placeholders, no line continued with a backslash)."""
    found = []
    for blocks, _ in _PARSED.values():
        for block in blocks:
            if block.language not in _SHELL:
                continue
            for offset, text in enumerate(block.code.splitlines(), start=1):
                command = text.split(" #")[0].strip()
                start = command.find("python -m lightning_optim.train")
                if start < 0 or command.endswith("\\"):
                    continue
                words = shlex.split(command[start:])[3:]
                if any(word.startswith("-") or "<" in word or "$" in word for word in words):
                    continue
                found.append(Command(block.page, block.line + offset, tuple(words)))
    return found


JOB_COMMANDS = job_commands()


def test_the_pages_have_job_commands():
    assert len(JOB_COMMANDS) >= 10, JOB_COMMANDS


@pytest.mark.parametrize("command", JOB_COMMANDS, ids=lambda command: command.id)
def test_job_command_composes_and_checks(command: Command, compose_train):
    from omegaconf import OmegaConf

    from lightning_optim.config_check import check_config

    cfg = OmegaConf.to_container(compose_train(*command.overrides), resolve=True)
    check_config(cfg)  # a ConfigError names the key at fault
