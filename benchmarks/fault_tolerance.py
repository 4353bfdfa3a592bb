"""Goodput of fault-tolerant DiLoCo (torchft) with a replica killed every T seconds, against a failure-free run and
against what users do today: a job that restarts from its last checkpoint when a rank dies.

Three variants run one after the other in one benchmark run, each training the main job's ByteGPT (model, data,
AdamW, schedule and DiLoCo outer settings from ``conf/``; ``benchmarks/fault_tolerance_worker.py``) on ``--replicas``
CPU processes (one torch thread each) to the same ``--steps`` inner steps, DiLoCo synchronising every
``--sync-every`` steps, every process saving its own checkpoint every ``--checkpoint-every`` steps:

* **failure-free**: the replicas as separate launches (``python fault_tolerance_worker.py --mode replica``), each
  ``DiLoCo(..., manager=replica_manager(...))``, around a Lighthouse (``local_lighthouse``) in this process;
* **fault-tolerant, a replica killed every T s**: the same; this process SIGKILLs one replica every ``--kill-every``
  seconds (round robin) and relaunches it at once: it is healed from a peer in DiLoCo's constructor at the
  survivors' next synchronisation and trains on from their step;
* **restart from checkpoint**: the same ranks as one job, plain DiLoCo over a gloo process group, launched by
  ``torchrun --standalone --max-restarts``; the same kill schedule SIGKILLs one rank; torchrun stops the others and
  restarts the whole job, which resumes from the newest checkpoint every rank holds (a plain torch script, as the
  replicas are: the main job has no resume option, and the same loop in every variant keeps the step cost equal).

Kills follow the wall clock: the first T seconds after the launch, each next one T seconds after the last; a kill
waits until its target trains, and none is made once the run is within two synchronisations of its end. The
Lighthouse and the managers of both fault-tolerant variants ask for ``replicas - 1`` replicas in a quorum (what a
kill leaves) and use torchft_lighthouse's default timeouts: a 60 s join timeout (a live replica a few steps behind
its peers is waited for, not left out of the round), a 5 s heartbeat timeout (a killed replica counts as gone
after it).

Figures, per variant:

* **goodput** = useful tokens / wall time, wall time from the launch to the last inner step. Useful tokens = tokens
  of inner steps whose progress entered a committed outer step: for a replica, the inner steps since its last
  committed synchronisation (or since it joined, or was healed) each time a synchronisation commits with its
  pseudo-gradient (weight 1); the steps of a killed replica since its last commit, of a replica healed over its
  own progress, and of a restarted job since its last checkpoint count nothing. A job that reaches ``--steps``
  without a failure counts replicas x steps; tokens per step = batch x sequence length. A variant stopped by
  ``--deadline-s`` counts what it committed (the restarted job: its newest complete checkpoint) over the time used.
* **per kill**: fault-tolerant: the time from the kill to the survivors' next committed step, and the survivors'
  extra delay (their synchronisation interval across the kill minus the failure-free run's median interval); the
  goal bounds it by one interval plus the longest a quorum waits for a dead replica (the heartbeat timeout: until
  it passes, the dead replica counts as a straggler still to join). Restart: the time from the kill to the job's
  next inner step after the restart, the inner steps lost (back to the checkpoint) and the time to regain them.
* **final loss**: the final model's mean cross-entropy on the main job's validation windows, every variant at
  ``--steps``; the ratios compare each variant with the failure-free run.

    python benchmarks/fault_tolerance.py                        # the measurement (about 40 min on 2 idle cores)
    python benchmarks/fault_tolerance.py --quick                # a dry run (200 steps, kills every 30 s); saves nothing
    python benchmarks/fault_tolerance.py --kill-every 60 --only failure_free,killed   # a subset saves nothing

Options: --replicas 3 --steps 3000 --sync-every 50 --checkpoint-every 100 --kill-every 120 --model tiny
--max-restarts 100 --deadline-s S (per variant; default 1.5 s a step + 120 s) --out DIR (the runs' events, logs
and checkpoints; default: a temporary folder).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RUST_LOG", "warn")  # the Lighthouse in this process logs every quorum at info
sys.path.insert(0, str(Path(__file__).resolve().parent))
from fault_tolerance_analysis import Events, summarise, summary_line
from fault_tolerance_worker import REPO, main_job_settings, newest_complete
from results import save

WORKER = Path(__file__).resolve().with_name("fault_tolerance_worker.py")
VARIANTS = {"failure_free": "fault-tolerant, no failures", "killed": "fault-tolerant, a replica killed every T s",
            "restart": "torchrun restart from checkpoint"}
# torchft_lighthouse's own defaults: a quorum waits up to the join timeout for replicas that heartbeat but have not
# joined (a replica a few steps behind its peers), and counts a replica silent for the heartbeat timeout as gone (a
# killed one). A short join timeout drops every straggler from the round: under DiLoCo it then waits for the next
# round and is healed, its inner steps discarded.
JOIN_TIMEOUT_MS, HEARTBEAT_TIMEOUT_MS = 60_000, 5000
POLL_S, GRACE_S = 0.2, 120.0


def child_env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def worker_args(args: argparse.Namespace, workdir: Path) -> list[str]:
    return [str(WORKER), "--steps", str(args.steps), "--sync-every", str(args.sync_every), "--checkpoint-every",
            str(args.checkpoint_every), "--model", args.model, "--checkpoints", str(workdir / "checkpoints")]


class Kills:
    """The kill schedule: the first ``every`` seconds after ``start``, each next ``every`` seconds after the last
    (round robin over ``targets``); none once the run's leading step reaches ``stop_at``."""

    def __init__(self, start: float, every: float | None, targets: list[str], stop_at: int) -> None:
        self.next = start + every if every else float("inf")
        self.every, self.targets, self.stop_at, self.count = every, targets, stop_at, 0
        self.made: list[dict] = []

    def due(self, lead: int) -> str | None:
        """The target of a kill due now, or None."""
        if time.time() < self.next:
            return None
        if lead >= self.stop_at:
            self.next = float("inf")
            return None
        return self.targets[self.count % len(self.targets)]

    def done(self, target: str, **facts) -> None:
        now = time.time()
        self.made.append({"target": target, "scheduled": self.next, "time": now, **facts})
        self.count += 1
        self.next = now + self.every


def run_replicas(args: argparse.Namespace, workdir: Path, kill_every: float | None) -> dict:
    """The fault-tolerant variants: replicas as separate launches, killed and relaunched on schedule."""
    from lightning_optim import fault_tolerance

    workdir.mkdir(parents=True)
    (workdir / "start").mkdir()
    minimum = max(1, args.replicas - 1)
    lighthouse = fault_tolerance.local_lighthouse(min_replicas=minimum, join_timeout_ms=JOIN_TIMEOUT_MS,
                                                  heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
    launches: dict[str, dict] = {}  # launch name -> replica, process, events
    latest: dict[str, str] = {}  # replica -> its latest launch

    def launch(replica: str, rejoin: bool) -> None:
        again = sum(n.startswith(replica + "#") for n in launches) + 1
        name = replica if replica not in latest else f"{replica}#{again}"
        extra = [] if rejoin else ["--start-dir", str(workdir / "start"), "--start-with", str(args.replicas)]
        argv = [sys.executable, *worker_args(args, workdir), "--mode", "replica", "--replica", replica,
                "--lighthouse", lighthouse.address(), "--min-replicas", str(minimum),
                "--events", str(workdir / f"{name}.jsonl"), *extra]
        with open(workdir / f"{name}.log", "w") as log:
            proc = subprocess.Popen(argv, cwd=REPO, env=child_env(), stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        launches[name] = {"replica": replica, "proc": proc, "events": Events(workdir / f"{name}.jsonl")}
        latest[replica] = name

    start = time.time()
    replicas = [f"r{i}" for i in range(args.replicas)]
    for replica in replicas:
        launch(replica, rejoin=False)
    kills = Kills(start, kill_every, replicas, args.steps - 2 * args.sync_every)
    deadline, grace, stopped = start + args.deadline_s, None, None
    try:
        while True:
            for item in launches.values():
                item["events"].read()
            current = [launches[latest[r]] for r in replicas]
            lead = max((item["events"].last_t() for item in launches.values()), default=0)
            target = kills.due(lead)
            if target is not None and launches[latest[target]]["events"].joined():
                victim = launches[latest[target]]
                os.killpg(victim["proc"].pid, signal.SIGKILL)
                victim["proc"].wait(30)
                kills.done(target, launch=latest[target], lead=lead)
                launch(target, rejoin=True)
            for name, item in launches.items():
                code = item["proc"].poll()
                if code not in (None, 0, -signal.SIGKILL):
                    raise RuntimeError(f"{name} exited with {code}:\n{(workdir / f'{name}.log').read_text()[-3000:]}")
            running = [item for item in current if item["proc"].poll() is None]
            if not running:
                break
            if grace is None and any(item["events"].done() for item in current):
                grace = time.time() + GRACE_S
            now = time.time()
            if now > deadline or (grace is not None and now > grace):
                what = "--deadline-s" if now > deadline else f"{GRACE_S:.0f} s after the first replica finished"
                left = [latest[r] for r in replicas if launches[latest[r]]["proc"].poll() is None]
                stopped = f"stopped: {', '.join(left)} still running {what}"
                print(f"{stopped} (logs in {workdir})", flush=True)
                break
            time.sleep(POLL_S)
    finally:
        for item in launches.values():
            if item["proc"].poll() is None:
                os.killpg(item["proc"].pid, signal.SIGKILL)
                item["proc"].wait(30)
        lighthouse.shutdown()
    return {"start": start, "stopped_at": time.time(), "stopped": stopped, "kills": kills.made,
            "launches": {name: {"replica": item["replica"], "events": item["events"].rows}
                         for name, item in launches.items()}}


def kill_worker(pid: int) -> None:
    """SIGKILL the worker process ``pid`` if it is still one of this benchmark's (its pid not reused)."""
    try:
        if WORKER.name in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
            os.kill(pid, signal.SIGKILL)
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass


def run_torchrun(args: argparse.Namespace, workdir: Path, kill_every: float | None) -> dict:
    """The baseline: one torchrun job of all ranks, restarted from its checkpoints after every kill."""
    events_dir = workdir / "events"
    events_dir.mkdir(parents=True)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.replicas}",
            f"--max-restarts={args.max_restarts}", *worker_args(args, workdir), "--mode", "rank",
            "--events", str(events_dir)]
    start = time.time()
    with open(workdir / "torchrun.log", "w") as log:
        proc = subprocess.Popen(argv, cwd=REPO, env=child_env(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    files: dict[str, Events] = {}
    kills = Kills(start, kill_every, [f"rank{r}" for r in range(args.replicas)], args.steps - 2 * args.sync_every)
    deadline, stopped = start + args.deadline_s, None
    try:
        while proc.poll() is None:
            for path in events_dir.glob("*.jsonl"):
                files.setdefault(path.stem, Events(path)).read()
            restart = max((int(n.split("restart")[1]) for n in files), default=0)
            lead = max((e.last_t() for e in files.values()), default=0)
            target = kills.due(lead)
            victim = files.get(f"{target}-restart{restart}")
            if target is not None and victim is not None and victim.joined() and not victim.done():
                try:
                    os.kill(victim.pid(), signal.SIGKILL)
                except ProcessLookupError:  # the job is being restarted: the next poll finds the new one
                    pass
                else:
                    kills.done(target, restart=restart, lead=lead)
            if time.time() > deadline:
                stopped = "stopped: the job still running after --deadline-s"
                print(f"{stopped} (logs in {workdir})", flush=True)
                break
            time.sleep(POLL_S)
        if stopped is None and proc.returncode != 0:
            tail = (workdir / "torchrun.log").read_text()[-3000:]
            raise RuntimeError(f"torchrun exited with {proc.returncode}:\n{tail}")
        for path in events_dir.glob("*.jsonl"):
            files.setdefault(path.stem, Events(path)).read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        for events in files.values():  # each worker has a process group of its own: killpg above left it
            if events.rows:
                kill_worker(events.pid())
    saved = newest_complete(workdir / "checkpoints", [f"rank{r}" for r in range(args.replicas)])
    return {"start": start, "stopped_at": time.time(), "stopped": stopped, "kills": kills.made,
            "checkpointed": saved or 0, "files": {name: e.rows for name, e in files.items()}}


def check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Refuse settings the variants cannot run with, naming the option."""
    if args.replicas < 2:
        parser.error(f"--replicas must be at least 2 (a kill leaves the others training), got {args.replicas}")
    for name in ("steps", "sync_every", "checkpoint_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.steps % args.sync_every or args.checkpoint_every % args.sync_every:
        parser.error(f"--steps ({args.steps}) and --checkpoint-every ({args.checkpoint_every}) must be multiples of "
                     f"--sync-every ({args.sync_every}): every variant ends on a synchronisation, checkpoints are "
                     "taken right after one")
    if args.kill_every <= 0 or args.deadline_s <= 0:
        parser.error(f"--kill-every and --deadline-s must be > 0 seconds, got {args.kill_every} and {args.deadline_s}")
    if args.max_restarts < 0:
        parser.error(f"--max-restarts must be >= 0, got {args.max_restarts}")
    unknown = set(args.only) - set(VARIANTS)
    if unknown:
        parser.error(f"--only: unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a dry run: 200 steps, kills every 30 s; saves nothing")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None, help="inner steps of every variant (3000; quick: 200)")
    parser.add_argument("--sync-every", type=int, default=None, help="DiLoCo's H (50; quick: 10)")
    parser.add_argument("--checkpoint-every", type=int, default=None, help="steps between checkpoints (100; quick: 20)")
    parser.add_argument("--kill-every", type=float, default=None, help="seconds between kills (120; quick: 30)")
    parser.add_argument("--model", default="tiny", help="the main job's model option (conf/model/<name>.yaml)")
    parser.add_argument("--max-restarts", type=int, default=100, help="torchrun's --max-restarts")
    parser.add_argument("--deadline-s", type=float, default=None, help="bound on each variant (default: 1.5 s a step)")
    parser.add_argument("--only", default=",".join(VARIANTS), help="variants to run (comma-separated)")
    parser.add_argument("--out", type=Path, default=None, help="where the runs' events, logs and checkpoints go")
    args = parser.parse_args(argv)
    quick = args.quick
    for name, full, short in (("steps", 3000, 200), ("sync_every", 50, 10), ("checkpoint_every", 100, 20),
                              ("kill_every", 120.0, 30.0)):
        if getattr(args, name) is None:
            setattr(args, name, short if quick else full)
    args.deadline_s = args.deadline_s or 1.5 * args.steps + 120
    args.only = [v for v in args.only.split(",") if v]
    check(args, parser)
    out = args.out or Path(tempfile.mkdtemp(prefix="fault-tolerance-"))
    taken = [key for key in args.only if (out / key).exists()]
    if taken:
        parser.error(f"--out {out} already holds the runs {taken} (their events would mix): give a fresh folder")
    out.mkdir(parents=True, exist_ok=True)
    cfg = main_job_settings(args.model)
    settings = {"replicas": args.replicas, "steps": args.steps, "sync_every": args.sync_every,
                "checkpoint_every": args.checkpoint_every, "kill_every_s": args.kill_every, "model": args.model,
                "model_sizes": cfg["model"], "batch_size": cfg["batch_size"], "seq_len": cfg["seq_len"],
                "tokens_per_step": cfg["batch_size"] * cfg["seq_len"], "join_timeout_s": JOIN_TIMEOUT_MS / 1000,
                "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_MS / 1000,
                "dead_replica_wait_s": min(JOIN_TIMEOUT_MS, HEARTBEAT_TIMEOUT_MS) / 1000,
                "min_replicas": max(1, args.replicas - 1),
                "max_restarts": args.max_restarts, "cores": os.cpu_count(), "torch_threads_per_process": 1}
    print(f"{args.replicas} replicas x {args.steps} steps, DiLoCo H={args.sync_every}, checkpoints every "
          f"{args.checkpoint_every} steps, a kill every {args.kill_every:.0f} s; runs in {out}", flush=True)
    runs = {}
    for key in args.only:
        began, load = time.time(), os.getloadavg()[0]
        kill_every = None if key == "failure_free" else args.kill_every
        workdir = out / key
        raw = run_torchrun(args, workdir, kill_every) if key == "restart" else run_replicas(args, workdir, kill_every)
        raw["loadavg_1min"] = [load, os.getloadavg()[0]]  # the variants run one after the other: what else ran
        (workdir / "raw.json").write_text(json.dumps(raw))
        shutil.rmtree(workdir / "checkpoints", ignore_errors=True)  # the events and logs stay
        runs[key] = raw
        print(f"{VARIANTS[key]}: {time.time() - began:.0f} s", flush=True)
    data = summarise(runs, settings, VARIANTS)
    for line in summary_line(data):
        print(line, flush=True)
    save("fault_tolerance", data, keep=not quick and set(args.only) == set(VARIANTS))


if __name__ == "__main__":
    main()
