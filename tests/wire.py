"""Bytes on the wire as the kernel counts them, independent of ``comm_stats()``."""

from __future__ import annotations

import os
import re
import subprocess


def wire_bytes_sent() -> int | None:
    """What this process's open TCP sockets to other ranks have sent (``ss -tinp``: gloo's pairs); None where
    ``ss`` is missing. Each byte once: ``bytes_sent`` counts retransmissions too, and loopback does retransmit
    (probes and spurious resends while the receiving rank is not scheduled: seen on an idle machine; CI saw a
    rank 53 KB "heavier" that way), so ``bytes_retrans`` is taken off. The rendezvous store's socket (to
    MASTER_PORT) is left out: it polls while ranks wait for each other, so its bytes follow the machine's load."""
    try:
        out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    store = f":{os.environ.get('MASTER_PORT', '')}"
    total, mine = 0, False
    for line in out.splitlines():
        if not line[:1].isspace():  # a socket's line; its counters follow on an indented line
            fields = line.split()
            mine = f"pid={os.getpid()}," in line and not any(f.endswith(store) for f in fields[3:5])
        elif mine and (found := re.search(r"\bbytes_sent:(\d+)", line)):
            retransmitted = re.search(r"\bbytes_retrans:(\d+)", line)
            total += int(found.group(1)) - (int(retransmitted.group(1)) if retransmitted else 0)
    return total


def assert_quiet_between_syncs(rows: list[dict], syncs) -> None:
    """Per-step rows (``step``, ``wire_bytes``) of a DiLoCo run: nothing on the wire outside the steps in
    ``syncs`` but, once, DDP's broadcast of its rebuilt bucket order after its first iteration (a few hundred
    bytes; a gradient all-reduce would be tens of KB a step)."""
    between = [r["wire_bytes"] for r in rows if r["step"] not in syncs]
    assert sum(between) < 1024 and between.count(0) >= len(between) - 1, between
