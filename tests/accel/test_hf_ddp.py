"""The HF Trainer with ``--optim onebit_adam`` parsed from a real command line under ``torchrun
--nproc_per_node 2`` (gloo, CPU): loss falls, compression engages (DDP buckets skipped, logged
compression ratio ~32x in the 1-bit steps), and ``resume_from_checkpoint`` (every rank's own
error-feedback state) ends bitwise equal to the uninterrupted run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from tests.distributed import run_torchrun  # noqa: E402

SCRIPT = Path(__file__).with_name("hf_script.py")
REPO = Path(__file__).resolve().parents[2]
COMMON = ["--optim", "onebit_adam", "--optim_args", "freeze_step=3,kahan_sum=False", "--learning_rate", "3e-3",
          "--max_steps", "8", "--save_steps", "4", "--logging_steps", "1", "--per_device_train_batch_size", "8",
          "--use_cpu", "--report_to", "none", "--seed", "0", "--max_grad_norm", "1.0"]


def _torchrun(out: Path, *extra: str) -> list[dict]:
    run_torchrun(SCRIPT, "--output_dir", out, *COMMON, *extra, cwd=REPO)
    return [torch.load(out / f"result{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf")
    full = _torchrun(tmp / "full")
    resumed = _torchrun(tmp / "resumed", "--resume_from_checkpoint", str(tmp / "full" / "checkpoint-4"))
    return full, resumed


def test_onebit_adam_from_the_command_line_compresses_under_ddp(runs):
    full, _ = runs
    assert full[0]["optimizer"] == "OnebitAdam"
    logs = [row for row in full[0]["log"] if "loss" in row]
    assert logs[-1]["loss"] < logs[0]["loss"]
    ratios = [row["comm/compression_ratio"] for row in logs]
    assert all(0.9 < r < 1.1 for r in ratios[:3]), ratios  # warmup: DDP's fp32 allreduce
    assert all(20 < r < 33 for r in ratios[4:]), ratios  # 1-bit steps
    assert full[0]["summary"]["buckets_skipped"] > 0
    for a, b in zip(full[0]["params"], full[1]["params"]):
        assert torch.equal(a, b)


def test_max_grad_norm_in_the_compression_stage_uses_one_agreed_norm(runs):
    full, _ = runs
    norms = [[row["grad_norm"] for row in run["log"] if "grad_norm" in row] for run in full]
    assert len(norms[0]) == 8 and norms[0] == norms[1]  # per-rank clipping would log each rank's own norm
    assert all(n > 0 for n in norms[0])


def test_resume_from_checkpoint_is_bitwise(runs):
    full, resumed = runs
    for rank in range(2):
        for a, b in zip(full[rank]["params"], resumed[rank]["params"]):
            assert torch.equal(a, b)


def test_the_hf_example_runs_as_it_is(tmp_path):
    done = run_torchrun(REPO / "examples" / "hf_trainer_onebit.py", "--optim", "onebit_adam", "--optim_args",
                        "freeze_step=10", "--max_steps", "24", "--output_dir", tmp_path, cwd=tmp_path)
    line = next(line for line in done.stdout.splitlines() if line.startswith("optim onebit_adam"))
    eval_loss = float(line.split("eval loss ")[1].split()[0])
    assert eval_loss < 5.0  # ln 256 = 5.55 before training
    assert "MB vs" in line
