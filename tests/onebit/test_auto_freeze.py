"""freeze_step="auto" on 2 real gloo ranks against the rule written from its equations
(tests/reference/auto_freeze.py) on the ranks' averaged gradients: both ranks end the warmup at the
reference's step, the stage follows (compression from the next step), and a checkpoint taken mid-warmup
resumes bitwise, choosing the same step. The decision is announced once (rank 0), naming the step and the rule
or cap that fired, also in a plain script; bad run lengths for the cap are refused by name."""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path

import pytest
import torch

from tests.onebit.auto_freeze_workers import KW, SAVE_AT, STEPS, grads, suite
from tests.ranks import run_ranks
from tests.reference.auto_freeze import auto_freeze_step

WORLD = 2


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(WORLD, suite)


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


@pytest.mark.parametrize("name", ["OnebitAdam", "OnebitLamb"])
def test_the_decision_is_announced_once_by_rank_0(ranks, name):
    expected = _expected()
    for key in ("announced", "announced_resumed"):  # the resumed run decides after its checkpoint: it says so too
        (message,) = ranks[0][name][key]
        assert message.startswith(f"{name}: freeze_step='auto' ends the warmup at step {expected}: the variance's "
                                  f"norm stayed within "), message
        assert f"through the last {KW['auto_freeze_window']} steps" in message
        assert message.endswith(f"1-bit compression from step {expected + 1}")
        assert ranks[1][name][key] == []  # every rank decides the same; one says it


def _capped(cls, **kw):
    param = torch.nn.Parameter(torch.ones(3))
    return param, cls([param], lr=1e-2, freeze_step="auto", **kw)


@pytest.mark.parametrize("cls_name", ["OnebitAdam", "OnebitLamb"])
def test_a_decision_by_the_cap_names_the_cap(cls_name):
    import lightning_optim
    from lightning_optim.onebit.auto_freeze import AutoFreezeDecision

    cls = getattr(lightning_optim, cls_name)
    for kw, run, cap, says in (({"auto_freeze_max": 3}, None, 3, "the cap auto_freeze_max=3"),
                               ({}, 40, 6, "the cap of 15% of the run's 40 steps (step 6)")):
        param, opt = _capped(cls, **kw)
        if run is not None:
            opt.limit_auto_freeze(run)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(cap + 2):
                param.grad = torch.ones(3)
                opt.step()
        announced = [str(w.message) for w in caught if w.category is AutoFreezeDecision]
        assert announced == [f"{cls_name}: freeze_step='auto' ends the warmup at step {cap}: {says} was reached "
                             f"before the variance settled; 1-bit compression from step {cap + 1}"]


BAD_RUNS = [(-100, ValueError), (0, ValueError), (2.5, TypeError), ("x", TypeError), (None, TypeError),
            (math.nan, TypeError), (True, TypeError)]
BAD_SHARES = [(0.0, ValueError), (1.5, ValueError), (-0.1, ValueError), (math.nan, ValueError), ("x", TypeError),
              (True, TypeError)]


@pytest.mark.parametrize("cls_name", ["OnebitAdam", "OnebitLamb"])
def test_limit_auto_freeze_refuses_a_bad_run_length_or_share_by_name(cls_name):
    import lightning_optim

    cls = getattr(lightning_optim, cls_name)
    _, opt = _capped(cls)
    for total, error in BAD_RUNS:
        with pytest.raises(error, match=r"^total_steps must be an integer"):
            opt.limit_auto_freeze(total)
    for share, error in BAD_SHARES:
        with pytest.raises(error, match=r"^share must be a number in \(0, 1\]"):
            opt.limit_auto_freeze(100, share)
    assert opt.freeze_step == 100000  # the default cap: nothing was changed
    opt.limit_auto_freeze(100, 1.0)
    assert opt.freeze_step == 100


def test_the_decision_reaches_a_plain_script_without_logging(tmp_path):
    from tests.distributed import run_module

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    env.pop("PYTHONWARNINGS", None)  # Python's default filters, as a user's shell has them
    done = run_module("tests.onebit.auto_freeze_script", [], cwd=tmp_path, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "freeze_step 3"
    lines = [line for line in done.stderr.splitlines() if "freeze_step='auto'" in line]
    assert len(lines) == 1 and ("OnebitAdam: freeze_step='auto' ends the warmup at step 3: the cap "
                                "auto_freeze_max=3 was reached") in lines[0], done.stderr[-2000:]
