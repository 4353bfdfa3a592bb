"""Lightning end-to-end: MasterWeightsPrecision (one device, DDPStrategy, strategy="onebit_adam"),
KahanPrecision, GradientRelease on 1 and 2 processes; every resumed run equals the uninterrupted
one; the documented conflicts raise."""

from __future__ import annotations

import csv

import pytest
import torch

from tests.distributed import run_workers
from tests.lightning import precision_workers as w


def _assert_resume_exact(result: dict) -> None:
    full, resumed = result["full"], result["resumed"]
    assert torch.equal(full["params"], resumed["params"])
    # the resumed run's batches are the uninterrupted run's second epoch, bitwise
    for a, b in zip(full["per_batch"][w.EPOCH:], resumed["per_batch"]):
        assert torch.equal(a, b)
    if "masters" in full:
        assert torch.equal(full["masters"], resumed["masters"])
        assert full["loss_scale"] == resumed["loss_scale"]


def _logged(path: str, key: str) -> list[float]:
    with open(path) as f:
        return [float(row[key]) for row in csv.DictReader(f) if row.get(key)]


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("one_device"))
    return {
        "fp16_master": w.fit_and_resume(0, 1, tmp, "fp16_master", plugin="fp16_master"),
        "bf16_master": w.fit_and_resume(0, 1, tmp, "bf16_master", plugin="bf16_master"),
        "kahan": w.fit_and_resume(0, 1, tmp, "kahan", plugin="bf16_kahan"),
        "release": w.fit_and_resume(0, 1, tmp, "release", release=True),
        "plain": w.fit(0, 1, f"{tmp}/plain"),
        "release_acc": w.fit(0, 1, f"{tmp}/release_acc", release=True, accumulate=2, scheduler=False),
    }


@pytest.mark.parametrize("name", ["fp16_master", "bf16_master", "kahan", "release"])
def test_one_device_resume_equals_uninterrupted(one_device, name):
    _assert_resume_exact(one_device[name])


def test_master_weights_on_one_device(one_device):
    full = one_device["fp16_master"]["full"]
    assert full["param_dtypes"] == ["torch.float16"] and full["opt_param_dtypes"] == ["torch.float32"]
    assert torch.equal(full["params"], full["masters"].half().float())  # the model is round16(masters)
    scales = _logged(full["metrics_csv"], "precision/loss_scale")
    assert len(scales) == full["global_step"] and scales[-1] > scales[0]  # grows every 2 clean steps
    assert one_device["bf16_master"]["full"]["loss_scale"] is None  # bf16: no scaling


def test_kahan_precision_keeps_norms_fp32_and_compensates(one_device):
    full = one_device["kahan"]["full"]
    assert full["param_dtypes"] == ["torch.bfloat16", "torch.float32"]
    assert full["kahan_states"] > 0


def test_gradient_release_on_one_device_equals_plain_training(one_device):
    assert torch.equal(one_device["release"]["full"]["params"], one_device["plain"]["params"])


def test_gradient_release_accumulates_into_the_optimizer_states(one_device):
    acc = one_device["release_acc"]
    # params move only on the second micro-batch of each pair; every micro-batch counted in the states
    moved = [not torch.equal(a, b) for a, b in zip(acc["per_batch"], acc["per_batch"][1:])]
    assert moved == [i % 2 == 0 for i in range(len(moved))]
    assert acc["state_steps"] == [2 * acc["global_step"]]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("two_ranks"))
    return run_workers(2, w.two_rank_suite, tmp, timeout=600)


@pytest.mark.parametrize("name", ["fp16_master_ddp", "fp16_master_onebit", "release_ddp"])
def test_two_ranks_agree_and_resume_exactly(two_ranks, name):
    for rank in two_ranks:
        _assert_resume_exact(rank[name])
    assert torch.equal(two_ranks[0][name]["full"]["params"], two_ranks[1][name]["full"]["params"])


def test_master_weights_under_ddp_and_onebit(two_ranks):
    for name in ("fp16_master_ddp", "fp16_master_onebit"):
        full = two_ranks[0][name]["full"]
        assert full["opt_param_dtypes"] == ["torch.float32"]
        assert torch.equal(full["params"], full["masters"].half().float())
        assert full["loss_scale"] == two_ranks[1][name]["full"]["loss_scale"]


def test_gradient_release_under_ddp_equals_plain_ddp(two_ranks):
    for rank in two_ranks:
        assert torch.equal(rank["release_ddp"]["full"]["params"], rank["plain_ddp"]["params"])
        assert torch.equal(rank["release_ddp_acc"]["params"], rank["plain_ddp_acc"]["params"])


def _mixed16():
    from lightning.pytorch.plugins.precision import MixedPrecision

    return [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(release=True, clip=1.0), ValueError, "gradient_clip_val=1.0"),
    (dict(release=True, plugin="fp16_master"), ValueError, "MasterWeightsPrecision"),
    (dict(release=True, strategy="onebit_adam"), ValueError, "OnebitAdamStrategy"),
    (dict(release=True, optimizer="torch_adamw"), TypeError, "needs a lightning_optim optimizer"),
    (dict(release=True, extra_plugins=_mixed16), ValueError, "16-mixed"),
])
def test_conflicts_raise_naming_the_conflict(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        w.fit(0, 1, str(tmp_path), max_steps=1, **kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(precision="32-true"), "precision: must be one of"), (dict(init_scale=0.0), "init_scale"),
    (dict(growth_interval=0), "growth_interval"), (dict(growth_factor=1.0), "growth_factor"), (dict(backoff_factor=2.0), "backoff_factor"),
])
def test_master_weights_precision_refuses_bad_arguments(kwargs, match):
    from lightning_optim.lightning import MasterWeightsPrecision

    with pytest.raises(ValueError, match=match):
        MasterWeightsPrecision(**kwargs)


def test_kahan_precision_warns_for_a_torch_optimizer(tmp_path):
    with pytest.warns(UserWarning, match="has no Kahan summation"):
        w.fit(0, 1, str(tmp_path), max_steps=1, plugin="bf16_kahan", optimizer="torch_adamw")


@pytest.mark.parametrize("bad_part", ["masters", "skipped_steps"])
def test_master_weights_precision_loads_all_parts_or_none(bad_part):
    # the scaler is loaded only after the masters and the counters passed their checks
    from lightning_optim.lightning import MasterWeightsPrecision

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).half()
    plugin = MasterWeightsPrecision("16-true")
    plugin.connect(model, [torch.optim.SGD(model.parameters(), lr=0.1)], [])
    state = plugin.state_dict()
    state["loss_scaler"]["loss_scale"] = state["loss_scaler"]["loss_scale"] / 4
    if bad_part == "masters":
        state["masters"]["masters"][0] = state["masters"]["masters"][0].long()
    else:
        state["skipped_steps"] = -1
    before = plugin.state_dict()
    with pytest.raises((TypeError, ValueError), match=bad_part):
        plugin.load_state_dict(state)
    after = plugin.state_dict()
    assert after["loss_scaler"] == before["loss_scaler"] and after["skipped_steps"] == before["skipped_steps"]
    assert all(torch.equal(a, b) for a, b in zip(after["masters"]["masters"], before["masters"]["masters"]))
