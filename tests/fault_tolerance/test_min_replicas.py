"""``min_replica_size``: below it the survivors wait at their next synchronisation, say so, and go on when the
replica returns; no synchronisation commits with fewer replicas. Replicas are separate launches
(tests/fault_tolerance/replica.py), the third killed with SIGKILL and relaunched a few seconds later."""
from __future__ import annotations

import itertools
import time

import pytest

from tests.fault_tolerance.harness import Replicas, check_run

pytest.importorskip("torchft")

STEPS = 60
OPTIONS = dict(steps=STEPS, sync_every=5, step_sleep=0.1, outer_lr=1.0, outer_momentum=0.5,
               min_replicas=3)


def test_survivors_wait_below_min_replica_size_and_resume(tmp_path):
    with Replicas(tmp_path, **OPTIONS) as run:
        run.start("r0", "r1", "r2")
        run.wait_for("r2", lambda e: e["t"] >= 12, "inner step 12")
        run.kill("r2")
        killed_at = run.read("r2")[-1]["t"]  # its last step: it died in the next one
        deadline = time.monotonic() + 60
        while "min_replica_size=3" not in run.log("r0"):
            assert time.monotonic() < deadline, "r0 did not say it waits for replicas within 60 s:\n" + run.log("r0")
            time.sleep(0.1)
        stalled = run.read("r0")[-1]["t"]  # the last step recorded: the next one waits in its synchronisation
        time.sleep(2.0)  # the survivors hold there while the third replica is away
        assert run.read("r0")[-1]["t"] == stalled <= killed_at + 5 and (stalled + 1) % 5 == 0
        run.launch("r2")
        runs = run.wait_all(["r0", "r1", "r2#1"])
        result = check_run(runs, STEPS)
    assert result["r2#1"]["joined_at"] == stalled + 1  # healed into the synchronisation the survivors waited in
    for name in ("r0", "r1"):
        events = runs[name]
        commits = [b for a, b in itertools.pairwise(events) if b["s"] > a["s"]]
        assert commits and all(e["participants"] == 3 for e in commits), name
