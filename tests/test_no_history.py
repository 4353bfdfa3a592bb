"""User-facing text and code comments describe the project as it is: none names an issue number, a work item,
a seed file, a work session or the date of a piece of work (``git log`` is the history).

Scanned: README.md, CONTRIBUTING.md, docs/, lightning_optim/, accel_plugins/, csrc/, conf/, examples/,
benchmarks/, the CI script and the packaging files - every line of their text files (docstrings, comments,
messages). The results page (docs/benchmarks.md) may carry dates: it says when each figure was measured. Link
targets and URLs are not prose and are left out. tests/ is not scanned (its own fixtures name these patterns).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DATED = {"docs/benchmarks.md"}  # the results page: when each figure was measured is part of the figure
AREAS = ["README.md", "CONTRIBUTING.md", "docs", "lightning_optim", "accel_plugins", "csrc", "conf", "examples",
         "benchmarks", ".ci/run", "mkdocs.yml", "pyproject.toml", "setup.py", "MANIFEST.in"]
TEXT_SUFFIXES = {".md", ".py", ".pyi", ".yaml", ".yml", ".toml", ".cfg", ".in", ".cpp", ".h", ".hpp", ".cu",
                 ".cuh", ".sh", ".js", ".css", ".html", ".txt", ""}
_MONTH = r"(?:jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec)[a-z]*\.?"
PATTERNS = {
    "an issue number": r"\bissues? (?:#\s*)?\d+|\bissues? (?:nos?\.? )?\d+",
    "an issue label": r"\(issues?\b|\bissue #",
    "a work item": r"\bitems? \d+(?:/\d+)?\b",
    "a seed file": r"\bseed (?:file|project|repo\w*|0\d\d)\b",
    "a work session": r"\bsessions?\b",
    "a history phrase": r"\blater also\b|\bTested \(tests/",
    "a date": rf"\b20\d\d-[01]\d-[0-3]\d\b|\b{_MONTH} [0-3]?\d(?:st|nd|rd|th)?,? 20\d\d\b|\b[0-3]?\d {_MONTH} 20\d\d\b",
}
_FOUND = re.compile("|".join(f"(?P<p{i}>{p})" for i, p in enumerate(PATTERNS.values())), re.IGNORECASE)
# Not prose: Markdown link targets "](...)", reference definitions "[x]: target", autolinks "<http...>", URLs and
# bare page anchors ("docs/benchmarks.md#kernels-issue-5").
_NOT_PROSE = re.compile(r"\]\([^)\s]*(?:\s+\"[^\"]*\")?\)|^\s*\[[^\]]+\]:\s*\S+|<https?://[^>]*>|https?://\S+|\S*\.md#\S*")


def files(area: str) -> list[Path]:
    top = ROOT / area
    found = [top] if top.is_file() else sorted(p for p in top.rglob("*") if p.is_file())
    return [path for path in found
            if "__pycache__" not in path.parts
            and (path.suffix in TEXT_SUFFIXES or path == top)]


def hits(text: str, dated: bool = False) -> list[tuple[int, str, str]]:
    """``(line, what, matched text)`` for each pattern found in the text's prose (``dated``: dates allowed)."""
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        for match in _FOUND.finditer(_NOT_PROSE.sub(" ", line)):
            what = list(PATTERNS)[int(next(name for name, value in match.groupdict().items() if value)[1:])]
            if not (dated and what == "a date"):
                found.append((number, what, match.group()))
    return found


@pytest.mark.parametrize("area", AREAS)
def test_no_history_in(area: str):
    assert files(area), f"{area}: nothing to scan (moved?)"
    found = [f"{path.relative_to(ROOT)}:{line}: {what} ({matched!r})"
             for path in files(area)
             for line, what, matched in hits(path.read_text(errors="replace"),
                                             dated=path.relative_to(ROOT).as_posix() in DATED)]
    assert not found, "describe what is, not how it came to be (git log is the history):\n" + "\n".join(found)


@pytest.mark.parametrize("text,what", [
    ("Contiguous storage (issue 13, item 1).", "an issue label"),
    ("see issue 21 for the goals", "an issue number"),
    ("the fix of issues 13 and 21", "an issue number"),
    ("issue #5", "an issue number"),
    ("done as item 3 of the plan", "a work item"),
    ("mlbench's optimizers (seed 004)", "a seed file"),
    ("added in this session", "a work session"),
    ("it later also learned hierarchies", "a history phrase"),
    ("## Tested (tests/optim/test_adam.py)", "a history phrase"),
    ("measured 2026-11-24", "a date"),
    ("measured on Nov 24, 2026", "a date"),
    ("measured on 24 November 2026", "a date"),
])
def test_the_patterns_catch_history(text: str, what: str):
    assert [found[1] for found in hits(text)][:1] == [what]


@pytest.mark.parametrize("text", [
    "[Kernels](docs/benchmarks.md#kernels-issue-5) and [GPU](../benchmarks.md#the-gpu-check-on-an-h100-2026-11-27)",
    "see docs/benchmarks.md#small-tensor-layouts-issue-13-item-1",
    "https://github.com/pytorch/pytorch/issues/12345",
    "the hook issues three all-reduces per bucket; a known torch issue: free DDP first",
    "torch==2.13.0, 40M params in 8 tensors, seed 0 or seed 42, the 2 items",
    "pytest_sessionfinish",
])
def test_link_targets_and_plain_words_pass(text: str):
    assert hits(text) == []
