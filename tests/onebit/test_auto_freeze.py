"""freeze_step="auto" on 2 real gloo ranks against the rule written from its equations
(tests/reference/auto_freeze.py) on the ranks' averaged gradients: both ranks end the warmup at the
reference's step, the stage follows (compression from the next step), and a checkpoint taken mid-warmup
resumes bitwise, choosing the same step."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_workers
from tests.onebit.auto_freeze_workers import KW, SAVE_AT, STEPS, grads, suite
from tests.reference.auto_freeze import auto_freeze_step

WORLD = 2


@pytest.fixture(scope="module")
def ranks():
    return run_workers(WORLD, suite)


def _expected() -> int:
    mean = [[sum(gs) / WORLD for gs in zip(*(grads(t, r) for r in range(WORLD)))] for t in range(1, STEPS + 1)]
    step = auto_freeze_step(mean, KW["betas"][1], KW["auto_freeze_window"], KW["auto_freeze_tolerance"], 100000)
    assert step is not None and KW["auto_freeze_window"] < step < STEPS - 5  # the run crosses it
    return step


@pytest.mark.parametrize("name", ["OnebitAdam", "OnebitLamb"])
def test_every_rank_ends_the_warmup_at_the_references_step(ranks, name):
    expected = _expected()
    for r in range(WORLD):
        run = ranks[r][name]
        assert run["chosen"] == expected, (name, r)
        needs = [row["needs"] for row in run["full"]]  # after step t: does step t+1 want averaged gradients?
        assert needs == [t < expected for t in range(1, STEPS + 1)], (name, r)
        assert [row["freeze_step"] for row in run["full"]][expected - 1:] == [expected] * (STEPS - expected + 1)


@pytest.mark.parametrize("name", ["OnebitAdam", "OnebitLamb"])
def test_a_checkpoint_mid_warmup_resumes_bitwise_and_chooses_the_same_step(ranks, name):
    assert SAVE_AT < _expected()
    for r in range(WORLD):
        full, resumed = ranks[r][name]["full"][SAVE_AT:], ranks[r][name]["resumed"]
        for a, b in zip(full, resumed):
            assert a["needs"] == b["needs"] and a["freeze_step"] == b["freeze_step"]
            assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"])), (name, r)


def test_a_known_run_length_caps_the_automatic_warmup():
    from lightning_optim import OnebitAdam

    def opt(**kw):
        return OnebitAdam([torch.zeros(2, requires_grad=True)], **kw)

    capped = opt(freeze_step="auto")
    capped.limit_auto_freeze(400)
    assert capped.freeze_step == 60  # 15% of the run, until the rule picks an earlier step
    given = opt(freeze_step="auto", auto_freeze_max=500)
    given.limit_auto_freeze(400)
    assert given.freeze_step == 500  # the user's cap stays
    fixed = opt(freeze_step=7)
    fixed.limit_auto_freeze(400)
    assert fixed.freeze_step == 7
