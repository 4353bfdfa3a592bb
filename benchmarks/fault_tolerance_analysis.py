"""The figures of ``benchmarks/fault_tolerance.py`` from its processes' events: goodput, the cost of each kill, loss.

Every training process appends JSON lines (``fault_tolerance_worker.py``): ``start``, ``joined`` (``t`` after a
heal or a resume, ``s`` the manager's committed step), one per inner step (``t``, ``s``, ``healed``, ``time``) and
``done`` (``eval``: the final validation loss). See ``fault_tolerance.py`` for the definitions used here.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path


class Events:
    """One process's events file, read as it grows (only whole lines)."""

    def __init__(self, path: Path) -> None:
        self.path, self.rows, self._offset = Path(path), [], 0

    def read(self) -> None:
        if not self.path.exists():
            return
        with open(self.path, "rb") as handle:
            handle.seek(self._offset)
            chunk = handle.read()
        whole = chunk[:chunk.rfind(b"\n") + 1]
        self._offset += len(whole)
        self.rows += [json.loads(line) for line in whole.decode().splitlines() if line.strip()]

    def last_t(self) -> int:
        return next((r["t"] for r in reversed(self.rows) if "t" in r), 0)

    def joined(self) -> bool:
        return any(r.get("event") == "joined" for r in self.rows)

    def done(self) -> bool:
        return any(r.get("event") == "done" for r in self.rows)

    def pid(self) -> int:
        return next(r["pid"] for r in self.rows if r.get("event") == "start")


def _steps(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "event" not in r]


def _event(rows: list[dict], name: str) -> dict | None:
    return next((r for r in rows if r.get("event") == name), None)


def replica_progress(rows: list[dict]) -> dict:
    """A replica launch's useful inner steps, the times it committed with its own progress, and the steps it
    held uncommitted at its end (lost if it was killed)."""
    joined = _event(rows, "joined")
    useful, commits, anchor, last_s, last_t = 0, [], None, None, None
    if joined is not None:  # joining is a quorum round too: the first commit of this launch
        anchor, last_s, last_t = joined["t"], joined["s"], joined["t"]
        commits.append(joined["time"])
    for row in _steps(rows):
        last_t = row["t"]
        if anchor is None or row["s"] <= last_s:
            continue
        if not row["healed"]:  # committed with this replica's pseudo-gradient (weight 1)
            useful += row["t"] - anchor
            commits.append(row["time"])
        anchor, last_s = row["t"], row["s"]  # committed, or healed to the peers' state
    return {"useful_steps": useful, "commits": commits, "uncommitted": 0 if anchor is None else last_t - anchor,
            "joined": None if joined is None else joined["time"], "steps_run": len(_steps(rows)),
            "last": rows[-1]["time"] if rows else None}


def commit_intervals(progress: dict[str, dict]) -> list[float]:
    """Every launch's time between consecutive commits of its own."""
    out = []
    for p in progress.values():
        out += [b - a for a, b in zip(p["commits"], p["commits"][1:])]
    return out


def replica_kills(raw: dict, progress: dict[str, dict], reference_s: float) -> list[dict]:
    """Per kill: time to the survivors' next committed step, their extra delay, the victim's lost steps, the
    relaunched replica's time back (healed, in the quorum)."""
    out = []
    launches = raw["launches"]
    for kill in raw["kills"]:
        at, victim = kill["time"], kill["launch"]
        survivors = [n for n, p in progress.items() if n != victim and p["joined"] and p["joined"] < at
                     and p["last"] and p["last"] > at]
        before = [c for n in survivors for c in progress[n]["commits"] if c <= at]
        after = [c for n in survivors for c in progress[n]["commits"] if c > at]
        back = [progress[n]["joined"] for n, item in launches.items()
                if item["replica"] == kill["target"] and progress[n]["joined"] and progress[n]["joined"] > at]
        interval = min(after) - max(before) if after and before else None
        out.append({"replica": kill["target"], "at_s": round(at - raw["start"], 1),
                    "to_next_commit_s": None if not after else min(after) - at,
                    "interval_s": interval, "extra_delay_s": None if interval is None else interval - reference_s,
                    "victim_lost_steps": progress[victim]["uncommitted"],
                    "back_in_s": min(back) - at if back else None})
    return out


def _rank_files(raw: dict) -> dict[int, dict[str, list[dict]]]:
    by_restart: dict[int, dict[str, list[dict]]] = {}
    for name, rows in raw["files"].items():
        rank, restart = name.split("-restart")
        by_restart.setdefault(int(restart), {})[rank] = rows
    return by_restart


def restart_kills(raw: dict) -> list[dict]:
    """Per kill of the torchrun job: time to its next inner step after the restart, steps lost, time to regain them."""
    by_restart = _rank_files(raw)
    out = []
    for kill in raw["kills"]:
        at, restart = kill["time"], kill["restart"]
        t_at = max((r["t"] for rows in by_restart.get(restart, {}).values() for r in _steps(rows) if r["time"] <= at),
                   default=0)
        later = [rows for k, ranks in by_restart.items() if k > restart for rows in ranks.values()]
        nxt = by_restart.get(restart + 1, {})
        first = min((r["time"] for rows in nxt.values() for r in _steps(rows)), default=None)
        joined = _event(nxt.get("rank0", []), "joined")
        resumed = None if joined is None else (joined["resumed"] or 0)
        regained = min((r["time"] for rows in later for r in _steps(rows) if r["t"] >= t_at), default=None)
        out.append({"rank": kill["target"], "at_s": round(at - raw["start"], 1), "step_at_kill": t_at,
                    "resumed_from": resumed, "lost_steps": None if resumed is None else t_at - resumed,
                    "to_next_step_s": None if first is None else first - at,
                    "to_regain_s": None if regained is None else regained - at})
    return out


def _end(rows_lists: list[list[dict]], steps: int) -> float | None:
    ends = [r["time"] for rows in rows_lists for r in _steps(rows) if r["t"] >= steps]
    return max(ends) if ends else None


def _loss(done_rows: list[dict]) -> tuple[float | None, float | None]:
    evals = [r["eval"] for r in done_rows if r]
    return (statistics.fmean(evals), max(evals) - min(evals)) if evals else (None, None)


def summarise(runs: dict[str, dict], settings: dict, labels: dict[str, str]) -> dict:
    """The saved figures: settings, one row per variant, the ratios to the failure-free run and the goals."""
    tokens = settings["tokens_per_step"]
    steps, replicas = settings["steps"], settings["replicas"]
    progress = {key: {name: replica_progress(item["events"]) for name, item in raw["launches"].items()}
                for key, raw in runs.items() if "launches" in raw}
    reference = [progress[k] for k in ("failure_free", "killed") if k in progress]
    intervals = commit_intervals(reference[0]) if reference else []
    ref_s = statistics.median(intervals) if intervals else 0.0
    rows = []
    for key, raw in runs.items():
        row = {"key": key, "label": labels[key], "kills": len(raw["kills"]), "loadavg_1min": raw.get("loadavg_1min")}
        if key in progress:
            p = progress[key]
            latest = {item["replica"]: name for name, item in raw["launches"].items()}  # launches are in order
            end = _end([item["events"] for item in raw["launches"].values()], steps)
            useful = sum(x["useful_steps"] for x in p.values())
            run_steps = sum(x["steps_run"] for x in p.values())
            loss, spread = _loss([_event(raw["launches"][n]["events"], "done") for n in latest.values()])
            row.update(per_kill=replica_kills(raw, p, ref_s), discarded=sum(
                max([r.get("discarded", 0) for r in _steps(item["events"])], default=0)
                for item in raw["launches"].values()))
        else:
            files = raw["files"]
            end = _end(list(files.values()), steps)
            # a job stopped before its end has what its newest complete checkpoint holds
            useful = replicas * (steps if end is not None else raw["checkpointed"])
            run_steps = sum(len(_steps(rows)) for rows in files.values())
            last = max(_rank_files(raw))
            loss, spread = _loss([_event(_rank_files(raw)[last].get("rank0", []), "done")])
            row.update(per_kill=restart_kills(raw), restarts=last)
        finished = end is not None and not raw["stopped"]
        wall = (end if finished else raw["stopped_at"]) - raw["start"]
        row.update(finished=finished, stopped=raw["stopped"], wall_s=wall, useful_tokens=useful * tokens,
                   run_tokens=run_steps * tokens, goodput_tokens_per_s=useful * tokens / wall,
                   final_val_loss=loss if finished else None, val_loss_spread=spread)
        rows.append(row)
    by = {r["key"]: r for r in rows}
    base = by.get("failure_free")
    for r in rows:
        ok = base and base["goodput_tokens_per_s"] and r["goodput_tokens_per_s"]
        r["goodput_vs_failure_free"] = r["goodput_tokens_per_s"] / base["goodput_tokens_per_s"] if ok else None
        ok = base and base["final_val_loss"] and r["final_val_loss"]
        r["loss_vs_failure_free_pct"] = 100 * (r["final_val_loss"] / base["final_val_loss"] - 1) if ok else None
    bound = ref_s + settings["dead_replica_wait_s"]
    extra = [k["extra_delay_s"] for k in by.get("killed", {}).get("per_kill", []) if k["extra_delay_s"] is not None]
    killed = by.get("killed", {})
    goals = {"goodput_ratio_min": 0.9, "loss_gap_max_pct": 2.0, "kill_cost_bound_s": bound,
             "goodput_met": None if killed.get("goodput_vs_failure_free") is None
             else killed["goodput_vs_failure_free"] >= 0.9,
             "loss_met": None if killed.get("loss_vs_failure_free_pct") is None
             else abs(killed["loss_vs_failure_free_pct"]) <= 2.0,
             "kill_cost_met": None if not extra else max(extra) <= bound}
    return {"settings": settings, "sync_interval_s": ref_s, "rows": rows, "goals": goals}


def _fmt(value, spec: str = ".1f", none: str = "-") -> str:
    return none if value is None else format(value, spec)


def summary_line(data: dict) -> list[str]:
    """The console's table and verdicts."""
    s = data["settings"]
    head = (f"{'variant':44s} {'kills':>5s} {'wall s':>7s} {'useful Mtok':>11s} {'goodput tok/s':>13s} "
            f"{'vs free':>7s} {'val loss':>8s} {'vs free':>7s}")
    lines = [head]
    for r in data["rows"]:
        lines.append(f"{r['label']:44s} {r['kills']:5d} {_fmt(r['wall_s'], '7.0f')} {r['useful_tokens'] / 1e6:11.2f} "
                     f"{_fmt(r['goodput_tokens_per_s'], '13.0f')} {_fmt(r['goodput_vs_failure_free'], '7.3f')} "
                     f"{_fmt(r['final_val_loss'], '8.4f')} {_fmt(r['loss_vs_failure_free_pct'], '+6.2f')}%")
    for r in data["rows"]:
        for k in r.get("per_kill", []):
            if "to_next_commit_s" in k:
                lines.append(f"  {r['key']}: kill {k['replica']} at {k['at_s']:.0f} s: survivors' next commit "
                             f"{_fmt(k['to_next_commit_s'])} s, interval {_fmt(k['interval_s'])} s (extra "
                             f"{_fmt(k['extra_delay_s'], '+.1f')} s), victim lost {k['victim_lost_steps']} steps, back "
                             f"in {_fmt(k['back_in_s'])} s")
            else:
                lines.append(f"  {r['key']}: kill {k['rank']} at {k['at_s']:.0f} s (step {k['step_at_kill']}): next "
                             f"step {_fmt(k['to_next_step_s'])} s after, resumed from {k['resumed_from']} "
                             f"({k['lost_steps']} steps lost), regained in {_fmt(k['to_regain_s'])} s")
    ratios = [f"{r['key']}/failure_free = {_fmt(r['goodput_vs_failure_free'], '.3f')}" for r in data["rows"]
              if r["key"] != "failure_free"]
    lines.append("goodput ratios: " + ", ".join(ratios))
    g = data["goals"]
    lines.append(f"median sync interval {data['sync_interval_s']:.1f} s; kill cost bound (interval + dead-replica "
                 f"wait) {g['kill_cost_bound_s']:.1f} s; goals met: goodput>=90% {g['goodput_met']}, loss within 2% "
                 f"{g['loss_met']}, kill cost {g['kill_cost_met']} ({s['replicas']} replicas on {s['cores']} cores)")
    return lines
