"""accel_plugins.enable_master_weights / enable_gradient_release under a real ``torchrun --nproc_per_node 2``
Accelerate run (gloo, CPU), each against a reference in the same process written with torch DDP and the
framework-free core by hand (tests/accel/precision_script.py); the four runs (masters full and resumed, release,
onebit) are phases of one launch (tests/accel/phases.py). Refusals in one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("accelerate")

from tests.accel.phases import rank_results, run_phases  # noqa: E402

SCRIPT = Path(__file__).with_name("precision_script.py")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    """Every run of precision_script.py, by name, from one launch."""
    tmp = tmp_path_factory.mktemp("precision")
    phases = {"full": ["mode=masters", "save_at=5"],
              "resumed": ["mode=masters", f"load={tmp / 'full' / 'ckpt'}", "start=5"],
              "release": ["mode=release"], "onebit": ["mode=onebit"]}
    run_phases(SCRIPT, [[tmp / name, *arguments] for name, arguments in phases.items()], cwd=REPO)
    return {name: rank_results(tmp / name) for name in phases}


@pytest.fixture(scope="module")
def masters(runs):
    return runs["full"], runs["resumed"]


def test_master_weights_equal_the_core_stepped_by_hand_under_ddp(masters):
    full, _ = masters
    for rank in range(2):
        run = full[rank]
        assert all(p.dtype == torch.float16 for p in run["params"])
        for a, b in zip(run["params"], run["reference"]["params"]):
            assert torch.equal(a, b)
        # the inf on rank 1 only: both ranks skip that step, the scale backs off, the LR does not advance
        skipped = [r["skipped"] for r in run["rows"]]
        assert skipped == run["reference"]["skipped"] and skipped[3] and sum(skipped) >= 1
        assert run["rows"][3]["scale"] == run["rows"][2]["scale"] / 2
        assert run["rows"][3]["lr"] == run["rows"][2]["lr"]
        # the clip saw the unscaled fp32 master grads (a scaled 16-bit norm would be ~S times larger)
        assert all(r["norm"] < 100 for i, r in enumerate(run["rows"]) if not r["skipped"])
    for a, b in zip(full[0]["params"], full[1]["params"]):
        assert torch.equal(a, b)


def test_master_weights_resume_through_save_state_is_bitwise(masters):
    full, resumed = masters
    for rank in range(2):
        for a, b in zip(full[rank]["params"], resumed[rank]["params"]):
            assert torch.equal(a, b)
        for a, b in zip(full[rank]["masters"], resumed[rank]["masters"]):
            assert torch.equal(a, b)
        assert full[rank]["rows"][5:] == resumed[rank]["rows"]


def test_gradient_release_equals_plain_ddp_with_accumulation(runs):
    for run in runs["release"]:
        for a, b in zip(run["released"], run["plain"]):
            assert torch.equal(a, b)
        assert run["lr"] < 1e-2  # the scheduler drove the released updates
        assert "no moment holds all of them to clip" in run["clip_error"]


def test_master_weights_with_onebit_adam_track_fp32(runs):
    ranks = runs["onebit"]
    for a, b in zip(ranks[0]["fp16"]["params"], ranks[1]["fp16"]["params"]):
        assert torch.equal(a, b)
    run = ranks[0]
    fp32_ring = 4 * run["fp16"]["numel"]  # DDP's fp32 ring allreduce on 2 ranks, per step
    assert not run["fp16"]["switch"] and run["fp16"]["skipped"] == 0
    assert all(fp32_ring / b > 20 for b in run["fp16"]["sent"][4:]), run["fp16"]["sent"]
    moved16 = torch.cat([(a - b).flatten() for a, b in zip(run["fp16"]["params"], run["initial"])])
    moved32 = torch.cat([(a - b).flatten() for a, b in zip(run["fp32"]["params"], run["initial"])])
    assert (moved16 - moved32).norm() < 0.05 * moved32.norm()


# ---------------------------------------------------------------------- refusals (one process)
def _prepared(dtype=torch.float16, optimizer_cls=None, **accelerator_kwargs):
    from accelerate import Accelerator

    import lightning_optim as lo

    accelerator = Accelerator(cpu=True, **accelerator_kwargs)
    model = nn.Linear(4, 2).to(dtype)
    optimizer = (optimizer_cls or lo.AdamW)(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


def test_master_weights_refusals():
    import accel_plugins

    accelerator, model, optimizer = _prepared(torch.float32)
    with pytest.raises(ValueError, match="model: no fp16/bf16 parameters"):
        accel_plugins.enable_master_weights(accelerator, model, optimizer)
    accelerator, model, optimizer = _prepared()
    accelerator.scaler = torch.amp.GradScaler("cpu")  # what mixed_precision="fp16" sets up
    with pytest.raises(ValueError, match="mixed_precision='fp16'.*GradScaler"):
        accel_plugins.enable_master_weights(accelerator, model, optimizer)
    accelerator, model, optimizer = _prepared()
    with pytest.raises(TypeError, match="loss_scaler: must be"):
        accel_plugins.enable_master_weights(accelerator, model, optimizer, loss_scaler="dynamic")
    handle = accel_plugins.enable_master_weights(accelerator, model, optimizer)
    with pytest.raises(RuntimeError, match="already enabled"):
        accel_plugins.enable_master_weights(accelerator, model, optimizer)
    with pytest.raises(ValueError, match="master weights step after checking"):
        accel_plugins.enable_gradient_release(accelerator, model, optimizer)
    handle.close()
    assert accelerator.scaler is None and "clip_grad_norm_" not in vars(accelerator)


def test_bf16_master_weights_do_not_scale_and_clip_the_masters():
    import accel_plugins

    accelerator, model, optimizer = _prepared(torch.bfloat16)
    handle = accel_plugins.enable_master_weights(accelerator, model, optimizer)
    assert handle.loss_scaler is None and handle.get_scale() == 1.0
    x = torch.randn(8, 4, dtype=torch.bfloat16)
    accelerator.backward(model(x).float().pow(2).sum() * 1e3)
    expected = torch.cat([p.grad.float().flatten() for p in model.parameters()]).norm()
    norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
    assert torch.allclose(norm, expected)
    clipped = torch.cat([m.grad.flatten() for m in handle.masters.masters])
    assert all(m.dtype == torch.float32 for m in handle.masters.masters)
    assert torch.allclose(clipped.norm(), torch.tensor(1.0), rtol=1e-4)
    optimizer.step()
    for p, m in zip(model.parameters(), handle.masters.masters):
        assert torch.equal(p, m.to(torch.bfloat16))  # the model holds the rounded masters


def test_gradient_release_refusals():
    import accel_plugins
    import lightning_optim as lo

    accelerator, model, optimizer = _prepared(torch.float32, optimizer_cls=torch.optim.AdamW)
    with pytest.raises(TypeError, match="optimizer: gradient release needs a lightning_optim optimizer"):
        accel_plugins.enable_gradient_release(accelerator, model, optimizer)
    accelerator, model, optimizer = _prepared(torch.float32)
    accelerator.scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(ValueError, match="GradScaler, which unscales and checks every gradient"):
        accel_plugins.enable_gradient_release(accelerator, model, optimizer)
    accelerator, model, optimizer = _prepared(torch.float32, optimizer_cls=lambda p, lr: lo.OnebitAdam(p, lr=lr))
    with pytest.raises(ValueError, match="1-bit optimizers communicate"):
        accel_plugins.enable_gradient_release(accelerator, model, optimizer)
    accelerator, model, optimizer = _prepared(torch.float32)
    release = accel_plugins.enable_gradient_release(accelerator, model, optimizer)
    with pytest.raises(ValueError, match="clip_grad_norm_ / clip_grad_value_"):
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(ValueError, match="clip_grad_norm_ / clip_grad_value_"):
        accelerator.clip_grad_value_(model.parameters(), 1.0)
    release.close()
    accelerator.clip_grad_norm_(model.parameters(), 1.0)  # Accelerate's own again


def test_gradient_release_in_one_process_equals_stepping_after_backward():
    import accel_plugins

    accelerator, released, opt_released = _prepared(torch.float32)
    plain = nn.Linear(4, 2)
    plain.load_state_dict(released.state_dict())
    import lightning_optim as lo

    opt_plain = lo.AdamW(plain.parameters(), lr=1e-3)
    release = accel_plugins.enable_gradient_release(accelerator, released, opt_released)
    for step in range(5):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        accelerator.backward(released(x).pow(2).mean())
        assert all(p.grad is None for p in released.parameters())  # freed during backward
        opt_released.step()  # a no-op: the loop stays as it was
        plain(x).pow(2).mean().backward()
        opt_plain.step()
        opt_plain.zero_grad()
    for a, b in zip(released.parameters(), plain.parameters()):
        assert torch.equal(a, b)
    release.close()
