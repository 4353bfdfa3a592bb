"""A rank that stops answering mid-training: the others stop with a clear error within the
strategy's ``timeout`` instead of hanging (Lightning's own launcher, real processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).with_name("fail_script.py")
# Also the start-up rendezvous bound (init_process_group): rank 1 must be up within it on a busy machine.
TIMEOUT = "20"


def test_hung_rank_stops_the_job_within_the_timeout(tmp_path):
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--mode", "hang", "--at-step", "3", "--timeout", TIMEOUT],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    try:
        _, err = proc.communicate(timeout=150)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the job (nothing, if all went well)
        except ProcessLookupError:
            pass
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert "rank 1: stops answering at step 3" in err
    assert "[rank 0] OnebitAdamStrategy: a collective failed" in err, err[-3000:]
    # the bound that fired: lightning-optim's own (the strategy sets it to `timeout`) or the group's
    assert f"timeout of {TIMEOUT}s" in err
    assert f"bound of {TIMEOUT}s" in err or "Timed out" in err, err[-3000:]
    assert elapsed < 120, f"took {elapsed:.0f}s"  # start-up + 20 s, not the 30-minute default


def test_a_rank_hung_before_a_diloco_exchange_is_named_by_the_others(tmp_path):
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--strategy", "diloco", "--mode", "hang", "--at-step", "3",
                             "--timeout", TIMEOUT], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    try:
        _, err = proc.communicate(timeout=150)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert "rank 1: stops answering at step 3" in err
    assert "CommunicationError: DiLoCo exchange of fragment 0 after inner step 3 failed on rank 0: rank 1 failed" in err, \
        err[-3000:]
    assert "[rank 0] DiLoCoStrategy: a collective failed" in err, err[-3000:]
    assert elapsed < 120, f"took {elapsed:.0f}s"
