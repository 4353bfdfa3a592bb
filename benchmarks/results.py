"""Where a benchmark's figures go: one JSON file per benchmark, read by ``results_page.py``.

``save(name, data)`` writes ``benchmarks/results/<name>.json`` with the figures plus what a reader needs to
trust and repeat them: the exact command, the date, the machine, the versions, the load average before and
after, the wall time. ``LIGHTNING_OPTIM_RESULTS=<dir>`` sends the files elsewhere (a trial run that should
not replace the page's figures). Smoke runs (``--quick``) pass ``keep=False`` and write nothing.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
REPO = RESULTS.parent.parent
_STARTED = time.time()
_LOAD_AT_START = os.getloadavg() if hasattr(os, "getloadavg") else None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _commit() -> str | None:
    """The library's commit, with ``+changes`` when the work tree differs from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "lightning_optim"],
                               cwd=REPO, capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+changes" if dirty else "")


def machine_facts() -> dict:
    """The machine and the software a figure was measured on."""
    import torch

    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"cpu": _cpu_model(), "cores": os.cpu_count(), "memory_gib": _memory_gib(),
            "os": f"{platform.system()} {platform.release()}", "python": platform.python_version(),
            "torch": torch.__version__, "lightning": _version("lightning"), "transformers": _version("transformers"),
            "lightning_optim": _commit(), "torch_threads": torch.get_num_threads(),
            "loadavg_1_5_15min": " ".join(f"{x:.2f}" for x in load) if load else "unknown"}


def save(name: str, data: dict, *, keep: bool = True) -> Path | None:
    """Write ``data`` as the current result of benchmark ``name`` (and print it as one ``JSON`` line)."""
    print("JSON " + json.dumps(data), flush=True)
    if not keep:
        return None
    script = Path(sys.argv[0])
    command = shlex.join(["python", f"benchmarks/{script.name}", *sys.argv[1:]])
    record = {"name": name, "command": command,
              "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "wall_s": round(time.time() - _STARTED, 1),
              "loadavg_at_start": " ".join(f"{x:.2f}" for x in _LOAD_AT_START) if _LOAD_AT_START else "unknown",
              "machine": machine_facts(), "data": data}
    folder = Path(os.environ.get("LIGHTNING_OPTIM_RESULTS", RESULTS))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")
    print(f"results: {path}", flush=True)
    return path
