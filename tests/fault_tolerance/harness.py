"""Replica groups as separate launches around a Lighthouse in the test process; kill, cut off and relaunch them.

    with Replicas(tmp_path, min_replicas=1) as run:
        run.launch("r0"); run.launch("r1"); run.launch("r2")
        run.wait_for("r2", lambda e: e["t"] >= 12)
        run.kill("r2")                       # SIGKILL
        run.launch("r2")                     # relaunched: the same replica id, a new events file
        results = run.wait_all()             # every launch's events, by launch name ("r2", "r2#1", ...)

Every wait is bounded and names what it waited for.
"""
from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from lightning_optim import fault_tolerance

REPLICA = Path(__file__).with_name("replica.py")
ROOT = Path(__file__).resolve().parents[2]


def read_events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]


class Replicas:
    """Launch replica processes (``replica.py``) against one Lighthouse."""

    def __init__(self, workdir: Path, *, lighthouse_min: int = 1, timeout: float = 120.0, lighthouse: str | None = None,
                 **options) -> None:
        """``lighthouse``: the address of a Lighthouse already running (else one starts in this process)."""
        self.workdir, self.timeout, self.options = Path(workdir), timeout, options
        self.lighthouse_min, self.lighthouse_address = lighthouse_min, lighthouse
        self.lighthouse = None
        self.procs: dict[str, subprocess.Popen] = {}
        self.events: dict[str, Path] = {}
        self.started = time.monotonic()

    def __enter__(self) -> Replicas:
        if self.lighthouse_address is None:
            self.lighthouse = fault_tolerance.local_lighthouse(min_replicas=self.lighthouse_min, join_timeout_ms=1000,
                                                               heartbeat_timeout_ms=2000)
            self.lighthouse_address = self.lighthouse.address()
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        if self.lighthouse is not None:
            self.lighthouse.shutdown()

    def start(self, *replicas: str, only: dict[str, dict] | None = None, **options) -> None:
        """Launch ``replicas`` together: each waits for the others' processes before it joins. ``only``: extra
        options of some of them, by replica."""
        start_dir = self.workdir / "start"
        start_dir.mkdir(exist_ok=True)
        for replica in replicas:
            self.launch(replica, start_with=len(replicas), start_dir=start_dir, **options,
                        **(only or {}).get(replica, {}))

    def launch(self, replica: str, *extra: str, prefix: list[str] | None = None, env: dict[str, str] | None = None,
               **options) -> str:
        """Start replica ``replica`` (again); returns its launch name. ``prefix``: a command it runs under
        (``ip netns exec NS``); ``env``: variables added to its environment."""
        name, n = replica, 0
        while name in self.procs:
            n += 1
            name = f"{replica}#{n}"
        events = self.workdir / f"{name}.jsonl"
        merged = {**self.options, **options}
        argv = [sys.executable, str(REPLICA), "--replica", replica, "--lighthouse", self.lighthouse_address,
                "--events", str(events)]
        for key, value in merged.items():
            flag = "--" + key.replace("_", "-")
            if value is True:
                argv.append(flag)
            elif value not in (None, False):
                argv += [flag, str(value)]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "RUST_LOG": "warn", **(env or {})}
        with open(self.workdir / f"{name}.log", "w") as log:  # the child keeps its own copy of the descriptor
            self.procs[name] = subprocess.Popen([*(prefix or []), *argv, *extra], cwd=ROOT, env=env, stdout=log,
                                                stderr=subprocess.STDOUT, start_new_session=True)
        self.events[name] = events
        return name

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text()[-4000:]

    def read(self, name: str) -> list[dict]:
        return read_events(self.events[name])

    def wait_for(self, name: str, condition, what: str = "", timeout: float | None = None) -> dict:
        """The first event of ``name`` meeting ``condition``; fails naming ``what`` after ``timeout``."""
        deadline = time.monotonic() + (timeout or self.timeout)
        while time.monotonic() < deadline:
            for event in self.read(name):
                if condition(event):
                    return event
            if self.procs[name].poll() is not None:
                raise AssertionError(f"{name} exited ({self.procs[name].returncode}) before {what}:\n{self.log(name)}")
            time.sleep(0.05)
        raise AssertionError(f"{name}: no event {what} within {timeout or self.timeout:.0f}s:\n{self.log(name)}")

    def kill(self, name: str) -> None:
        os.killpg(self.procs[name].pid, signal.SIGKILL)
        self.procs[name].wait(10)

    def wait_exit(self, name: str, timeout: float | None = None) -> int:
        try:
            return self.procs[name].wait(timeout or self.timeout)
        except subprocess.TimeoutExpired:
            bound = timeout or self.timeout
            raise AssertionError(f"{name} still running after {bound:.0f}s:\n{self.log(name)}") from None

    def wait_all(self, names=None) -> dict[str, list[dict]]:
        """Wait for the launches that are still running (all, or ``names``) to exit 0; every launch's events."""
        for name in names or list(self.procs):
            if self.procs[name].returncode is None or name in (names or []):
                code = self.wait_exit(name)
                assert code == 0, f"{name} exited {code}:\n{self.log(name)}"
        return {name: self.read(name) for name in self.procs}


def committed_checksums(runs: dict[str, list[dict]]) -> dict[int, set[int]]:
    """Committed step -> the checksums of the global params that every launch held at it."""
    seen: dict[int, set[int]] = {}
    for events in runs.values():
        for event in events:
            seen.setdefault(event["s"], set()).add(event["crc"])
    return seen


def check_run(runs: dict[str, list[dict]], steps: int) -> dict[str, float]:
    """What every fault-tolerant run must show, whatever failed: every launch that finished stepped through
    every inner step to ``steps`` and evaluated; every committed step is held with one set of global params
    by every launch that reached it (an exchange is applied whole or not at all); every finished launch ends
    with the same params. Returns each finished launch's evaluation loss and its longest pause between steps."""
    committed = committed_checksums(runs)
    split = {s: len(crcs) for s, crcs in committed.items() if len(crcs) > 1}
    assert not split, f"committed steps held with different global params: {split}"
    finished = {name: events for name, events in runs.items() if events and events[-1].get("done")}
    assert finished, "no launch finished"
    ends = set()
    out = {}
    for name, events in finished.items():
        steps_seen = [e["t"] for e in events if "loss" in e]
        first = events[0]["t"]
        assert steps_seen == list(range(first + 1, steps + 1)), f"{name} skipped or repeated inner steps"
        ends.add(events[-1]["params"])
        times = [e["time"] for e in events]
        out[name] = {"eval": events[-1]["eval"], "longest_pause_s": max(b - a for a, b in itertools.pairwise(times)),
                     "joined_at": first, "discarded": events[-1]["discarded"]}
    assert len(ends) == 1, f"the finished launches end with different params: {out}"
    return out


def replica_threads(fn, world: int, *, lighthouse_min: int | None = None, delays: dict[int, float] | None = None,
                    wait_s: float = 120.0) -> list:
    """``fn(replica, lighthouse_address)`` on ``world`` threads around one in-process Lighthouse (quorums of at
    least ``lighthouse_min``, default ``world``); replica ``r`` starts after ``delays[r]`` seconds. Results by
    replica; the first error is re-raised; a thread still running after ``wait_s`` fails the call."""
    import threading

    lighthouse = fault_tolerance.local_lighthouse(min_replicas=world if lighthouse_min is None else lighthouse_min)
    out: list = [None] * world
    errors: list = []

    def main(r: int) -> None:
        try:
            time.sleep((delays or {}).get(r, 0.0))
            out[r] = fn(r, lighthouse.address())
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(wait_s)
    lighthouse.shutdown()
    assert not any(t.is_alive() for t in threads), f"a replica thread did not finish within {wait_s:.0f} s"
    if errors:
        raise errors[0]
    return out
