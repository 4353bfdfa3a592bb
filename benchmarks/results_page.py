"""Writes the docs site's results page, ``docs/benchmarks.md``, and its plots from ``benchmarks/results/*.json``.

    python benchmarks/results_page.py           # the page, its plots and the README's results list
    python benchmarks/results_page.py --check   # exit 1 if the page or the README differs from what the files give

Every benchmark saves its figures with ``results.save`` (command, date, machine, versions included); a re-run
of a benchmark followed by this script updates its section. The sections, their method text and their tables
live in ``results_sections.py``; nothing here holds a measured number.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import RESULTS  # noqa: E402
from results_sections import INTRO, SECTIONS, headlines  # noqa: E402

PAGE = RESULTS.parents[1] / "docs" / "benchmarks.md"
README = RESULTS.parents[1] / "README.md"
START, END = "<!-- results: written by benchmarks/results_page.py -->", "<!-- results: end -->"


def load(folder: Path = RESULTS) -> dict[str, dict]:
    """Every saved result, by benchmark name."""
    return {path.stem: json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))}


def render(results: dict[str, dict]) -> str:
    """The page's Markdown: the introduction, then each section from its files (or a note that they are missing)."""
    parts = [INTRO]
    for section in SECTIONS:
        parts.append(section.render(results))
    return "\n".join(part.rstrip("\n") + "\n" for part in parts)


def with_headlines(readme: str, results: dict[str, dict]) -> str:
    """The README with its headline results (between the two markers) taken from the files."""
    head, found, rest = readme.partition(START)
    if not found or END not in rest:
        raise SystemExit(f"README.md lacks the markers {START} ... {END}")
    return head + START + "\n" + "\n".join(headlines(results)) + "\n" + END + rest.split(END, 1)[1]


def draw(results: dict[str, dict], docs: Path) -> list[Path]:
    """The page's plots, from the same files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for section in SECTIONS:
        for name, figure in section.plots(results, plt):
            path = docs / name
            figure.tight_layout()
            figure.savefig(path, dpi=110, metadata={"Software": None})
            plt.close(figure)
            written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare the page with the files; write nothing")
    parser.add_argument("--no-plots", action="store_true", help="write the page only")
    args = parser.parse_args(argv)
    results = load()
    wanted = {PAGE: render(results), README: with_headlines(README.read_text(), results)}
    if args.check:
        stale = [path for path, text in wanted.items() if (path.read_text() if path.exists() else "") != text]
        for path in stale:
            sys.stdout.writelines(difflib.unified_diff(path.read_text().splitlines(True),
                                                       wanted[path].splitlines(True), str(path),
                                                       "from benchmarks/results/", n=1))
        print(f"out of date: {[p.name for p in stale]}: run python benchmarks/results_page.py" if stale
              else "the results page and the README's results match benchmarks/results/")
        return 1 if stale else 0
    for path, text in wanted.items():
        path.write_text(text)
        print(f"wrote {path}")
    if not args.no_plots:
        for path in draw(results, PAGE.parent):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
