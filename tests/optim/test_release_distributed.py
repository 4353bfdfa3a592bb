"""Gradient release prepared before the process group exists, then run under DDP on 2 real gloo
ranks launched by torchrun: the hooks refuse to step un-averaged gradients, on every rank, before
anything changes (they used to step silently and the ranks drifted apart)."""

from __future__ import annotations

from pathlib import Path

from tests.distributed import run_torchrun

SCRIPT = Path(__file__).with_name("release_script.py")


def test_release_hooks_refuse_un_averaged_gradients_on_every_rank(tmp_path):
    done = run_torchrun(SCRIPT, cwd=tmp_path, timeout=180)
    outcomes = sorted(tmp_path.glob("rank*.txt"))
    assert [p.name for p in outcomes] == ["rank0.txt", "rank1.txt"], done.stdout + done.stderr[-3000:]
    lines = [p.read_text().strip() for p in outcomes]
    for line in lines:
        assert "unchanged=True state=0" in line, line
        assert "gradient release on a plain module is single-process: with 2 ranks" in line, line
