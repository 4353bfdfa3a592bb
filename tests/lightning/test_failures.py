"""A rank that stops answering mid-training: the others stop with a clear error within the
strategy's ``timeout`` instead of hanging (Lightning's own launcher, real processes)."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from tests.distributed import run_module

REPO = Path(__file__).resolve().parents[2]
# Also the rendezvous bound (init_process_group), which rank 0 enters once rank 1 enters it (fail_script.py).
TIMEOUT = "10"


def _run_job(cwd: Path, *args: str, step: int = 3) -> tuple[int, str, float]:
    """``python -m tests.lightning.fail_script *args`` (Lightning's launcher starts rank 1): exit status, stderr, and the seconds from the moment
    rank 1 stopped answering to the job's end (start-up, which a loaded machine stretches, is not counted)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    job = run_module("tests.lightning.fail_script", [*args, "--timeout", TIMEOUT], cwd=cwd, env=env, timeout=400)
    ended = time.time()
    stopped = re.search(rf"rank 1: stops answering at step {step} \(hang\) at ([0-9.]+)", job.stderr)
    assert stopped, job.stderr[-3000:]
    return job.returncode, job.stderr, ended - float(stopped.group(1))


def _report_delay(err: str, step: int) -> float:
    """Seconds from rank 1's hang to rank 0's failure reaching Lightning's callbacks."""
    stopped = re.search(rf"rank 1: stops answering at step {step} \(hang\) at ([0-9.]+)", err)
    reported = re.search(r"rank 0: failure reported at ([0-9.]+)", err)
    assert stopped and reported, err[-3000:]
    return float(reported.group(1)) - float(stopped.group(1))


def test_hung_rank_stops_the_job_within_the_timeout(tmp_path):
    returncode, err, elapsed = _run_job(tmp_path, "--mode", "hang", "--at-step", "3")
    assert returncode != 0
    assert "rank 1: stops answering at step 3" in err
    assert "[rank 0] OnebitAdamStrategy: a collective failed" in err, err[-3000:]
    # the bound that fired: lightning-optim's own (the strategy sets it to `timeout`) or the group's
    assert f"timeout of {TIMEOUT}s" in err
    assert f"bound of {TIMEOUT}s" in err or "Timed out" in err, err[-3000:]
    assert elapsed < 100, f"took {elapsed:.0f}s"  # 10 s and a teardown, not the 30-minute default


def test_a_rank_hung_before_a_diloco_exchange_is_named_by_the_others(tmp_path):
    returncode, err, elapsed = _run_job(tmp_path, "--strategy", "diloco", "--mode", "hang", "--at-step", "3")
    assert returncode != 0
    assert "rank 1: stops answering at step 3" in err
    assert "CommunicationError: DiLoCo exchange of fragment 0 after inner step 3 failed on rank 0: rank 1 failed" in err, \
        err[-3000:]
    assert "[rank 0] DiLoCoStrategy: a collective failed" in err, err[-3000:]
    assert elapsed < 100, f"took {elapsed:.0f}s"


def test_a_rank_hung_between_diloco_syncs_is_named_within_one_timeout(tmp_path):
    """Rank 1 hangs before step 2 (sync_every=3: no exchange there): rank 0 meets it in Lightning's stop-signal
    broadcast before batch 3, which the strategy bounds and does not let pass, so the report comes within one
    timeout, not after that broadcast's timeout and then the exchange's."""
    returncode, err, _ = _run_job(tmp_path, "--strategy", "diloco", "--mode", "hang", "--at-step", "2", step=2)
    assert returncode != 0
    assert ("CommunicationError: Lightning's stop-signal broadcast before training batch 3 failed on rank 0: rank 1 "
            "failed") in err, err[-3000:]
    assert "[rank 0] DiLoCoStrategy: a collective failed" in err, err[-3000:]
    delay = _report_delay(err, 2)
    assert float(TIMEOUT) * 0.9 < delay < float(TIMEOUT) * 1.5, f"reported {delay:.1f}s after the hang"
