"""``OnebitAdamStrategy(overlap=True)`` on 2 gloo ranks in a real Trainer: the overlapped exchange gives the
params of the same units compressed at step() time, bit for bit, through the stage switch; a resume from
Lightning's checkpoint inside the compression stage continues bitwise; gradient clipping is refused."""

from __future__ import annotations

import pytest
import torch

from lightning_optim.lightning import OnebitAdamStrategy
from tests.distributed import run_workers
from tests.lightning.overlap_workers import overlap_suite
from tests.lightning.workers import RESUME_EPOCH


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_workers(2, overlap_suite, str(tmp_path_factory.mktemp("overlap")), timeout=300)


def test_overlapped_equals_step_time_and_resumes_bitwise(runs):
    for rank, res in enumerate(runs):
        full, step_time, resumed = res["full"], res["step_time"], res["resumed"]
        assert full["global_step"] == 2 * RESUME_EPOCH and full["units"] > 1
        assert full["units_overlapped"] == full["units"] * (2 * RESUME_EPOCH - 4)  # every compression step
        assert step_time["units_overlapped"] == 0
        assert sorted(full["params"]) == list(range(1, 2 * RESUME_EPOCH + 1)) == sorted(step_time["params"])
        assert sorted(resumed["params"]) == list(range(RESUME_EPOCH + 1, 2 * RESUME_EPOCH + 1))
        for step, params in full["params"].items():
            assert torch.equal(params, step_time["params"][step]), f"rank {rank}, step {step}"
        for step, params in resumed["params"].items():
            assert torch.equal(params, full["params"][step]), f"rank {rank}, resumed step {step}"
    assert torch.equal(runs[0]["full"]["params"][2 * RESUME_EPOCH], runs[1]["full"]["params"][2 * RESUME_EPOCH])


def test_gradient_clipping_is_refused(runs):
    assert "before gradient_clip_val could clip them" in runs[0]["clip_refused"]


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(overlap=1), TypeError, "overlap must be True or False"),
    (dict(overlap_unit_mb=1.0), ValueError, "overlap_unit_mb needs overlap=True"),
])
def test_bad_overlap_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        OnebitAdamStrategy(freeze_step=4, **kwargs)
