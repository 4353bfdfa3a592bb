"""A Python environment holding torch and nothing else: a venv without system packages whose site-packages
links to torch and to the distributions torch itself requires (read from torch's metadata, markers evaluated),
taken from the running interpreter's installation. Nothing is downloaded or copied."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement


def _closure(name: str) -> dict[str, metadata.Distribution]:
    """``name``'s distribution and every installed one it requires, recursively (extras left out)."""
    found: dict[str, metadata.Distribution] = {}
    todo = [name]
    while todo:
        wanted = todo.pop()
        try:
            dist = metadata.distribution(wanted)
        except metadata.PackageNotFoundError:
            continue  # a requirement this platform's build does without (e.g. CUDA libraries on the CPU build)
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in found:
            continue
        found[key] = dist
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return found


def _top_level_entries(dist: metadata.Distribution) -> set[str]:
    """The names in site-packages that belong to ``dist`` (packages, modules, its .dist-info)."""
    entries = set()
    for file in dist.files or []:
        first = file.parts[0]
        if first != "..":  # scripts installed outside site-packages
            entries.add(first)
    return entries


def make(root: Path) -> Path:
    """Create the environment under ``root``; returns its interpreter."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    python = root / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True, timeout=60).stdout.strip()
    site = Path(purelib)
    for dist in _closure("torch").values():
        for entry in _top_level_entries(dist):
            source = Path(str(dist.locate_file(entry)))
            if source.exists() and not (site / entry).exists():
                (site / entry).symlink_to(source)
    return python
