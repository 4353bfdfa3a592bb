"""accel_plugins.enable_onebit under a real ``torchrun --nproc_per_node 2`` Accelerate run (gloo, CPU):
compression engages after freeze_step with DDP's allreduce off, the ranks stay identical, the bytes
per compressed step are ~1/32 of DDP's fp32 allreduce, and a save_state/load_state resume equals the
uninterrupted run bitwise. The full and the resumed run are phases of one launch (tests/accel/phases.py); the
example is its own launch, run as users run it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")

from tests.accel.phases import rank_results, run_phases  # noqa: E402
from tests.distributed import run_torchrun  # noqa: E402

SCRIPT = Path(__file__).with_name("accelerate_script.py")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("accelerate")
    run_phases(SCRIPT, [[tmp / "full", "save_at=6"], [tmp / "resumed", f"load={tmp / 'full' / 'ckpt'}", "start=6"]],
               cwd=REPO)
    return rank_results(tmp / "full"), rank_results(tmp / "resumed")


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


def test_compression_stage_clip_uses_one_norm_agreed_by_the_ranks(runs):
    full, _ = runs
    for step, (r0, r1) in enumerate(zip(full[0]["rows"], full[1]["rows"])):
        if step < 4:  # warmup: DDP averaged the grads, Accelerate's own clip on identical grads
            assert r0["clip_norm"] == r1["clip_norm"] == pytest.approx(r0["local_norm"], rel=1e-6)
            continue
        assert r0["local_norm"] != r1["local_norm"]  # local gradients differ per rank
        agreed = math.sqrt((r0["local_norm"] ** 2 + r1["local_norm"] ** 2) / 2)
        assert r0["clip_norm"] == r1["clip_norm"] == pytest.approx(agreed, rel=1e-6)
        for r in (r0, r1):  # every rank scaled by the same min(1, 1 / N)
            assert r["clipped_norm"] == pytest.approx(r["local_norm"] * min(1.0, 1.0 / agreed), rel=1e-5)


def test_save_state_load_state_resume_is_bitwise(runs):
    full, resumed = runs
    for rank in range(2):
        for a, b in zip(full[rank]["params"], resumed[rank]["params"]):
            assert torch.equal(a, b)
        assert [r["loss"] for r in full[rank]["rows"][6:]] == [r["loss"] for r in resumed[rank]["rows"]]


def test_a_group_accelerate_left_single_process_is_reported():
    from tests.accel.refusal_workers import single_process_trap
    from tests.distributed import run_workers

    for message in run_workers(2, single_process_trap, timeout=120):
        assert "process group of 2 ranks exists but Accelerate runs 1 process" in message, message
        assert "Accelerator(cpu=True)" in message and "accelerate#2741" in message


def test_a_foreign_comm_hook_is_refused():
    from tests.accel.refusal_workers import foreign_comm_hook
    from tests.distributed import run_workers

    for message in run_workers(2, foreign_comm_hook, timeout=120):
        assert "already has a comm hook" in message, message


def test_non_onebit_optimizer_and_bad_names_are_refused():
    from accelerate import Accelerator

    import accel_plugins

    model = torch.nn.Linear(4, 2)
    accelerator = Accelerator(cpu=True)
    with pytest.raises(TypeError, match="needs a 1-bit optimizer.*to_onebit_optimizer"):
        accel_plugins.enable_onebit(accelerator, model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(ValueError, match="name: must be one of"):
        accel_plugins.to_onebit_optimizer(torch.optim.AdamW(model.parameters()), "onebit_sgd")
    with pytest.raises(TypeError, match="OnebitLamb can replace"):
        accel_plugins.to_onebit_optimizer(torch.optim.AdamW(model.parameters()), "onebit_lamb")


def test_grad_scaler_is_refused():
    from accelerate import Accelerator

    import accel_plugins

    model = torch.nn.Linear(4, 2)
    accelerator = Accelerator(cpu=True)
    accelerator.scaler = torch.amp.GradScaler("cpu")  # what mixed_precision="fp16" sets up
    onebit = accel_plugins.to_onebit_optimizer(torch.optim.AdamW(model.parameters()), "onebit_adam")
    with pytest.raises(ValueError, match="GradScaler"):
        accel_plugins.enable_onebit(accelerator, model, onebit)


def test_the_accelerate_example_runs_as_it_is():
    done = run_torchrun(REPO / "examples" / "accelerate_onebit.py", cwd=REPO)
    lines = [line for line in done.stdout.splitlines() if line.startswith("step")]
    assert "(DDP fp32 allreduce)" in lines[0] and "(1-bit)" in lines[-1]
    assert float(lines[-1].split("loss")[1].split()[0]) < float(lines[0].split("loss")[1].split()[0])
