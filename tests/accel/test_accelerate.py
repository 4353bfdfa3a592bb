"""accel_plugins.enable_onebit under a real ``torchrun --nproc_per_node 2`` Accelerate run (gloo, CPU):
compression engages after freeze_step with DDP's allreduce off, the ranks stay identical, the bytes
per compressed step are ~1/32 of DDP's fp32 allreduce, and a save_state/load_state resume equals the
uninterrupted run bitwise."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")

from tests.distributed import free_port  # noqa: E402

SCRIPT = Path(__file__).with_name("accelerate_script.py")
REPO = Path(__file__).resolve().parents[2]


def _torchrun(out: Path, *args: str) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(SCRIPT), str(out), *args]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("accelerate")
    full = _torchrun(tmp / "full", "save_at=6")
    resumed = _torchrun(tmp / "resumed", f"load={tmp / 'full' / 'ckpt'}", "start=6")
    return full, resumed


def test_compression_engages_and_ranks_stay_identical(runs):
    full, _ = runs
    assert full[0]["world"] == 2
    for a, b in zip(full[0]["params"], full[1]["params"]):
        assert torch.equal(a, b)
    rows = full[0]["rows"]
    # the switch is read before each forward: on for the warmup steps, off once the optimizer compresses
    assert [r["ddp_allreduce"] for r in rows] == [s < 4 for s in range(10)]
    numel = full[0]["numel"]
    fp32_ring = 4 * numel  # DDP's fp32 ring allreduce on 2 ranks: 2 (W-1)/W * 4 bytes per element
    warm = [r["bytes"] for r in rows[:4]]
    compressed = [r["bytes"] for r in rows[5:]]
    assert all(abs(b - fp32_ring) < 0.01 * fp32_ring for b in warm[1:]), (warm, fp32_ring)
    ratios = [fp32_ring / b for b in compressed]
    assert all(25 < r <= 32.5 for r in ratios), ratios  # sign bits + per-segment scales and headers
    assert full[0]["summary"]["buckets_skipped"] > 0


def test_save_state_load_state_resume_is_bitwise(runs):
    full, resumed = runs
    for rank in range(2):
        for a, b in zip(full[rank]["params"], resumed[rank]["params"]):
            assert torch.equal(a, b)
        assert [r["loss"] for r in full[rank]["rows"][6:]] == [r["loss"] for r in resumed[rank]["rows"]]
