"""Formatting for the results page: the run facts above each table, tables, numbers."""

from __future__ import annotations

from collections.abc import Callable

MB = 1e6  # the page's MB: 10^6 bytes


def run_facts(record: dict) -> list[str]:
    """Where and how a file's figures were measured, and the command that measures them again."""
    m = record["machine"]
    memory = f", {m['memory_gib']} GiB" if m.get("memory_gib") else ""
    software = [f"Python {m['python']}", f"torch {m['torch']}"]
    software += [f"Lightning {m['lightning']}"] if m.get("lightning") else []
    software += [f"lightning-optim {m['lightning_optim']}"] if m.get("lightning_optim") else []
    wall = f", {record['wall_s']:.0f} s" if record.get("wall_s") else ""
    load = m.get("loadavg_1_5_15min", "unknown")
    lines = [f"*{record['name']}.json*: {m['cpu']}, {m['cores']} cores{memory}; {', '.join(software)}; "
             f"{record['date']}{wall}; load average (1, 5, 15 min) {record.get('loadavg_at_start', 'unknown')} "
             f"before, {load} after.", ""]
    if record.get("transcribed"):
        lines += [f"*{record['transcribed']}*", ""]
    lines += ["```bash", record["command"], "```", ""]
    return lines


def table(headers: list[str], rows: list[list], align: str = "") -> list[str]:
    """A Markdown table; ``align`` gives each column's alignment (l or r), left by default."""
    marks = ["---:" if (align[i:i + 1] == "r") else "---" for i in range(len(headers))]
    out = ["| " + " | ".join(headers) + " |", "| " + " | ".join(marks) + " |"]
    out += ["| " + " | ".join("-" if cell is None else str(cell).replace("|", "\\|") for cell in row) + " |"
            for row in rows]
    return out + [""]


def f(value, digits: int = 2, suffix: str = "") -> str:
    return "-" if value is None else f"{value:,.{digits}f}{suffix}"


def x(value, digits: int = 2) -> str:
    return f(value, digits, "x")


def pct(value, digits: int = 1, sign: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+.{digits}f}%" if sign else f"{value:.{digits}f}%"


def span(values: list[float], fmt: Callable[[float], str]) -> str:
    lo, hi = min(values), max(values)
    return fmt(lo) if fmt(lo) == fmt(hi) else f"{fmt(lo)}-{fmt(hi)}"


def reading(text: str) -> list[str]:
    return [f"**How to read it.** {text}", ""]
