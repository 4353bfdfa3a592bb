"""DynamicLossScaler against the reference schedule (tests/reference/loss_scale_schedule.py), on one
process and on 2 gloo ranks where only one rank overflows at a time: every rank skips the same steps."""

from __future__ import annotations

import pytest
import torch

from lightning_optim.precision import DynamicLossScaler, LossScaleUnderflow
from tests.ranks import run_ranks
from tests.precision.scaler_workers import run_schedule
from tests.reference.loss_scale_schedule import simulate

PATTERN = [False, True, False, False, False, True, True, False, False, False, False, False, True, True, True,
           False, False, False, False, False, False, False]
CONFIGS = [
    dict(init_scale=1024.0, scale_factor=2.0, scale_window=3, min_scale=1e-4),
    dict(init_scale=256.0, scale_factor=4.0, scale_window=2, min_scale=1.0, max_scale=512.0, hysteresis=2),
    dict(init_scale=64.0, scale_factor=2.0, scale_window=4, min_scale=1e-3, hysteresis=1, backoff_factor=0.25),
]


def _reference(kwargs: dict, pattern: list[bool]):
    return simulate(pattern, init=kwargs["init_scale"], factor=kwargs["scale_factor"],
                    window=kwargs["scale_window"], min_scale=kwargs["min_scale"],
                    max_scale=kwargs.get("max_scale", float("inf")), hysteresis=kwargs.get("hysteresis", 1),
                    backoff=kwargs.get("backoff_factor"))


@pytest.mark.parametrize("kwargs", CONFIGS, ids=range(len(CONFIGS)))
def test_schedule_matches_reference_on_one_process(kwargs):
    got = run_schedule(0, 1, PATTERN, kwargs)
    used, skipped, underflow = _reference(kwargs, PATTERN)
    assert (got["used"], got["skipped"], got["underflow"]) == (used, skipped, underflow)


def test_two_ranks_skip_the_same_steps_when_one_rank_overflows():
    kwargs = CONFIGS[1]
    results = run_ranks(2, run_schedule, PATTERN, kwargs, timeout=60)
    used, skipped, underflow = _reference(kwargs, PATTERN)
    for res in results:
        assert (res["used"], res["skipped"], res["underflow"]) == (used, skipped, underflow)
    assert results[0]["state"] == results[1]["state"]


def test_backing_off_below_min_scale_raises_and_changes_nothing():
    pattern = [True] * 10
    kwargs = dict(init_scale=8.0, scale_factor=2.0, scale_window=5, min_scale=1.0)
    got = run_schedule(0, 1, pattern, kwargs)
    _, _, underflow = _reference(kwargs, pattern)
    assert got["underflow"] == underflow == 3 and "min_scale=1" in got["message"]
    scaler = DynamicLossScaler(init_scale=1.0, min_scale=1.0)
    with pytest.raises(LossScaleUnderflow, match="below min_scale"):
        scaler.update(True)
    assert scaler.loss_scale == 1.0


def test_state_dict_round_trip_continues_the_schedule():
    kwargs = CONFIGS[1]
    full = DynamicLossScaler(**kwargs)
    first = DynamicLossScaler(**kwargs)
    for overflow in PATTERN[:7]:
        full.update(overflow)
        first.update(overflow)
    resumed = DynamicLossScaler(**kwargs)
    resumed.load_state_dict(first.state_dict())
    for overflow in PATTERN[7:]:
        full.update(overflow)
        resumed.update(overflow)
        assert resumed.loss_scale == full.loss_scale
    assert resumed.state_dict() == full.state_dict()


@pytest.mark.parametrize("name,value,error", [
    ("init_scale", 0.0, ValueError), ("init_scale", "x", TypeError), ("scale_factor", 1.0, ValueError),
    ("scale_window", 0, ValueError), ("scale_window", 2.5, TypeError), ("min_scale", -1.0, ValueError),
    ("max_scale", 1.0, ValueError), ("hysteresis", 0, ValueError), ("backoff_factor", 1.0, ValueError),
    ("process_group", "x", TypeError),
])
def test_bad_arguments_are_refused_by_name(name, value, error):
    with pytest.raises(error, match=name):
        DynamicLossScaler(**{name: value})


def test_scale_multiplies_the_loss_and_numpy_scalars_work():
    import numpy as np

    scaler = DynamicLossScaler(init_scale=np.float32(8.0), scale_window=np.int64(3))
    assert scaler.scale(torch.tensor(2.0)).item() == 16.0
