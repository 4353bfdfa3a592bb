"""What the fault-tolerant DiLoCo tests of Accelerate and the HF Trainer share: replica groups launched as users
launch them (``python script.py ...``, one process each) around a Lighthouse in the test process, with every
wait bounded and named; the reference run (``tests/reference/diloco.py`` on two workers) and the comparison of
both replicas' params with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from lightning_optim import fault_tolerance
from tests.accel.diloco_data import SYNC_EVERY
from tests.reference.diloco import RefDiLoCo

REPO = Path(__file__).resolve().parents[2]
REPLICAS = ("r0", "r1")
STEPS, SAVE_AT = 12, 6  # SAVE_AT lies between the synchronisations after steps 4 and 8 (SYNC_EVERY = 4)
SYNCS = [s for s in range(1, STEPS + 1) if s % SYNC_EVERY == 0]
WAIT_S = 180.0  # the bound of every launch (interpreters importing torch, accelerate, torchft on 2 loaded cores)


def lighthouse(min_replicas: int):
    """A Lighthouse in this process: ``min_replicas=2`` makes every quorum of a failure-free run hold both replicas
    (none can start alone and be healed into the other's run); 1 lets a survivor go on alone."""
    return fault_tolerance.local_lighthouse(min_replicas=min_replicas, join_timeout_ms=1000, heartbeat_timeout_ms=2000)


def launch(script: Path, log: Path, *args: str) -> subprocess.Popen:
    """``python script *args`` in a session of its own (killed with its children), output into ``log``."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "RUST_LOG": "warn"}
    with open(log, "w") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen([sys.executable, str(script), *args], cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``'s session, bounded."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def wait_all(procs: dict[str, tuple[subprocess.Popen, Path]], timeout: float = WAIT_S) -> None:
    """Every launch exits 0 within ``timeout`` (else: the failure names the replica, with its log's end); none is
    left running."""
    deadline = time.monotonic() + timeout
    try:
        for name, (proc, log) in procs.items():
            try:
                code = proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"replica {name} still running after {timeout:.0f}s:\n"
                                     f"{log.read_text()[-4000:]}") from None
            assert code == 0, f"replica {name} exited {code}:\n{log.read_text()[-4000:]}"
    finally:
        for proc, _ in procs.values():
            kill(proc)


def launch_replicas(script: Path, out: Path, tag: str, args: Callable[[int, str], list[str]]) -> None:
    """Both replicas of ``script`` launched together (``args(index, replica)``: each one's command line), waited
    for; logs in ``out/<tag>_<replica>.log``."""
    procs = {}
    for index, replica in enumerate(REPLICAS):
        log = out / f"{tag}_{replica}.log"
        procs[replica] = (launch(script, log, *args(index, replica)), log)
    wait_all(procs)


def flat(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


def run_reference(module: torch.nn.Module, make_inner: Callable, grads: Callable) -> list[list[torch.Tensor]]:
    """RefDiLoCo (outer SGD lr 0.7, Nesterov momentum 0.9: DiLoCo's defaults) on two workers from ``module``'s
    params, STEPS steps of ``grads(worker, step, params)``; every step's flat params, per worker."""
    ref = RefDiLoCo([p.detach().clone() for p in module.parameters()], 2, make_inner, sync_every=SYNC_EVERY)
    per_step = []
    for _ in range(STEPS):
        ref.step(grads)
        per_step.append([flat(worker) for worker in ref.workers])
    return per_step


def check_against_reference(per_replica: list[list[torch.Tensor]], expected: list[list[torch.Tensor]]) -> None:
    """Both replicas' params after every step: equal right after each sync, apart between (their data differ),
    and the reference's."""
    for step in range(1, STEPS + 1):
        mine = [rows[step - 1] for rows in per_replica]
        assert torch.equal(mine[0], mine[1]) == (step in SYNCS), step
        for w in range(2):
            torch.testing.assert_close(mine[w], expected[step - 1][w], rtol=0, atol=1e-6)
