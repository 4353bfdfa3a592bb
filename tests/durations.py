"""Refresh ``tests/durations.json`` (seconds per test file, from a pytest JUnit report), which ``tests/conftest.py``
schedules the longest files first by (a stale figure costs wall time, never a result):

    python -m pytest -q -n 2 --dist loadfile tests --junitxml=/tmp/r.xml && python tests/durations.py /tmp/r.xml
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

DURATIONS = Path(__file__).with_name("durations.json")


def per_file(report: Path) -> dict[str, float]:
    """Seconds per test file (``tests/...py``) in a JUnit report (classnames ``tests.pkg.test_x[.Class]``)."""
    root = Path(__file__).resolve().parent.parent
    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(report).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")
        for end in range(len(parts), 0, -1):  # the longest prefix that is a file: the rest are classes
            candidate = "/".join(parts[:end]) + ".py"
            if (root / candidate).is_file():
                seconds[candidate] += float(case.get("time", 0))
                break
    return {name: round(value, 1) for name, value in sorted(seconds.items(), key=lambda kv: -kv[1])}


if __name__ == "__main__":
    found = per_file(Path(sys.argv[1]))
    DURATIONS.write_text(json.dumps(found, indent=1) + "\n")
    print(f"{DURATIONS}: {len(found)} files, {sum(found.values()):.0f} s in all")
