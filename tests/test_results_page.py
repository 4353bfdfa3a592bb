"""The results page is generated from the files the benchmarks wrote, and stays so.

``docs/benchmarks.md`` must equal what ``benchmarks/results_page.py`` renders from ``benchmarks/results/*.json``;
every section must have its files; every file must be read by a section; and each section's figures must come
from its files (scaling every measured number in a file changes the section).
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import results_page  # noqa: E402
from results_sections import SECTIONS  # noqa: E402

RECORD_KEYS = {"name", "command", "date", "machine", "data"}
# Benchmarks whose section exists before their figures are measured for the page: the file may be missing (the
# section says "Not measured yet"); once it is saved every check here applies to it. tests/test_results_race.py
# renders the race's section from a record its own code makes.
MEASURED_LATER: set[str] = set()
MACHINE_KEYS = {"cpu", "cores", "python", "torch"}


def test_page_matches_the_saved_results():
    assert results_page.main(["--check"]) == 0, "run: python benchmarks/results_page.py"


def test_every_section_has_its_files_and_every_file_a_section():
    saved = results_page.load()
    wanted = {name for section in SECTIONS for name in section.files}
    assert sorted(wanted - saved.keys() - MEASURED_LATER) == [], "sections without their results file"
    assert sorted(saved.keys() - wanted) == [], "results files no section reads"


@pytest.mark.parametrize("name", sorted(path.stem for path in (BENCHMARKS / "results").glob("*.json")))
def test_a_record_says_where_and_how_it_was_measured(name):
    record = json.loads((BENCHMARKS / "results" / f"{name}.json").read_text())
    assert RECORD_KEYS <= record.keys()
    assert record["name"] == name
    assert MACHINE_KEYS <= record["machine"].keys()
    assert record["command"].startswith(("python benchmarks/", "bash benchmarks/"))


def _scaled(value, factor: float):
    """``value`` with every float in it multiplied by ``factor`` (ints, strings and flags kept)."""
    if isinstance(value, float):
        return value * factor
    if isinstance(value, dict):
        return {key: _scaled(item, factor) for key, item in value.items()}
    if isinstance(value, list):
        return [_scaled(item, factor) for item in value]
    return value


@pytest.mark.parametrize("section", SECTIONS, ids=lambda s: s.title)
def test_a_section_shows_its_files_figures(section):
    saved = results_page.load()
    missing = [name for name in section.files if name not in saved]
    if missing and set(missing) <= MEASURED_LATER:
        pytest.skip(f"{missing}: not measured yet")
    before = section.render(saved)
    changed = copy.deepcopy(saved)
    for name in section.files:
        changed[name]["data"] = _scaled(changed[name]["data"], 1.37)
    assert section.render(changed) != before


def test_a_missing_file_is_said_not_invented():
    section = SECTIONS[0]
    text = section.render({})
    assert "Not measured yet" in text and f"benchmarks/results/{section.files[0]}.json" in text
    assert not any(ch.isdigit() for ch in text.split("Not measured yet")[1].replace(section.files[0], ""))
