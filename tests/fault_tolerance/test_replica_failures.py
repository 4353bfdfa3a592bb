"""Replicas that die, as separate launches over one Lighthouse: a dead replica costs the survivors one
synchronisation, not the job, and a relaunched one rejoins.

Each replica is its own process (tests/fault_tolerance/replica.py: a small regression trained with
``DiLoCo(..., manager=replica_manager(...))``, 150 inner steps, a synchronisation every 5). One replica is
killed with SIGKILL between synchronisations, or inside an exchange (its all-reduce in flight, the survivors'
waiting on it), and relaunched; ``check_run`` then holds (every inner step taken by the survivors, one set of
global params per committed step on every launch, one final model), the relaunched replica joined mid-run and
ends with the survivors' params, and the final loss stays within 5% of the failure-free run's.
"""
from __future__ import annotations

import pytest

from tests.fault_tolerance.harness import Replicas, check_run

pytest.importorskip("torchft")

STEPS = 150  # the survivors still train when a relaunched replica is up, also on a loaded machine
OPTIONS = dict(steps=STEPS, sync_every=5, step_sleep=0.1, outer_lr=1.0, outer_momentum=0.5)


@pytest.fixture(scope="module")
def failure_free(tmp_path_factory) -> dict:
    with Replicas(tmp_path_factory.mktemp("failure_free"), **OPTIONS) as run:
        run.start("r0", "r1", "r2")
        result = check_run(run.wait_all(), STEPS)
    assert {r["discarded"] for r in result.values()} == {0}
    assert {r["joined_at"] for r in result.values()} == {0}
    return result


def _check_relaunched(result: dict, failure_free: dict, *, discarded: bool) -> None:
    assert set(result) == {"r0", "r1", "r2#1"}, result  # the killed launch never finished
    assert result["r2#1"]["joined_at"] > 0  # healed into the run in progress, not started over
    survivors = [result["r0"], result["r1"]]
    assert all(r["discarded"] >= 1 for r in survivors) if discarded else True
    baseline = failure_free["r0"]["eval"]
    assert abs(result["r0"]["eval"] - baseline) <= 0.05 * baseline, (result, failure_free)


def test_sigkill_between_synchronisations_then_relaunch(tmp_path, failure_free):
    with Replicas(tmp_path, **OPTIONS) as run:
        run.start("r0", "r1", "r2")
        run.wait_for("r2", lambda e: e["t"] >= 12, "inner step 12 (between the syncs after steps 10 and 15)")
        run.kill("r2")
        run.launch("r2")
        result = check_run(run.wait_all(["r0", "r1", "r2#1"]), STEPS)
    _check_relaunched(result, failure_free, discarded=False)


def test_sigkill_inside_an_exchange_then_relaunch(tmp_path, failure_free):
    with Replicas(tmp_path, **OPTIONS) as run:
        run.start("r0", "r1", "r2", only={"r2": {"die_in_exchange": 3}})  # in the 4th synchronisation
        assert run.wait_exit("r2") != 0
        run.launch("r2")
        result = check_run(run.wait_all(["r0", "r1", "r2#1"]), STEPS)
    _check_relaunched(result, failure_free, discarded=True)
