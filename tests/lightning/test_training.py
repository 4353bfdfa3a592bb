"""``Trainer(strategy=...)`` end to end on 2 gloo ranks with the main job's model (tiny sizes),
crossing each optimizer's stage change (the ``runs`` fixture: one spawn, ``workers.suite``)."""

from __future__ import annotations

import csv
import math

import pytest
import torch

from tests.lightning.workers import CASES, RESUME_EPOCH

FREEZE = 4  # freeze_step / var_freeze_step of every case in workers.CASES
EXPECTED = {"onebit_adam": "OnebitAdam", "zero_one_adam": "ZeroOneAdam", "onebit_lamb": "OnebitLamb"}
STEPS = 2 * RESUME_EPOCH
AGREEMENT_BYTES = 8 * 5  # per step and peer: the 1-bit optimizers' layout agreement (5 int64s, 1 peer)


@pytest.mark.parametrize("case", list(CASES))
def test_converted_optimizer_trains(runs, case):
    for rank in range(2):
        result = runs[rank][case]
        assert result["optimizer"] == EXPECTED[case] and result["average_grads"] is False
        assert result["global_step"] == STEPS and result["scheduler_bound"]
        assert result["group_sizes"] == runs[rank][case]["group_sizes"] and len(result["group_sizes"]) == 2
        assert [g["weight_decay"] for g in result["param_groups"]] == [0.1, 0.0]
        losses = [row["loss"] for row in result["rows"]]
        assert all(math.isfinite(x) for x in losses)
        assert sum(losses[-3:]) / 3 < losses[0] - 0.05, losses


@pytest.mark.parametrize("case", list(CASES))
def test_ddp_allreduce_is_off_when_the_optimizer_communicates(runs, case):
    rows = runs[0][case]["rows"]
    for row in rows:
        fp32 = row["fp32_bytes"]
        assert fp32 > 50_000  # what DDP's fp32 ring allreduce of the ~18K params sends
        if row["ddp_allreduce"]:  # DDP's allreduce plus the optimizer's 40-byte layout agreement
            assert row["bytes_sent"] == fp32 + AGREEMENT_BYTES and row["enabled"]
        else:  # the optimizer's 1-bit collectives only (or just the agreement, on ZeroOneAdam's local steps)
            assert row["bytes_sent"] < fp32 / 25
    # OnebitAdam/OnebitLamb: exactly the warmup steps use DDP's allreduce
    ddp_steps = [row["step"] for row in rows if row["ddp_allreduce"]]
    if case != "zero_one_adam":
        assert ddp_steps == list(range(1, FREEZE + 1))
    else:  # variance steps 1, 2, 4 (var_interval doubles every variance step), then none
        assert ddp_steps == [1, 2, 4]
        assert any(row["bytes_sent"] == AGREEMENT_BYTES for row in rows)  # local steps without synchronisation
    summary = runs[0][case]["summary"]
    assert summary["steps"] == STEPS and summary["bytes_sent"] == sum(row["bytes_sent"] for row in rows)
    assert runs[0][case]["skipped"] > 0  # DDP buckets returned without communication


@pytest.mark.parametrize("case", list(CASES))
def test_gradient_clip_uses_one_norm_agreed_by_the_ranks_when_the_optimizer_averages(runs, case):
    agreed_steps = 0
    for r0, r1 in zip(runs[0][case]["rows"], runs[1][case]["rows"]):
        if r0["ddp_allreduce"] or (case == "zero_one_adam" and r0["step"] > FREEZE):
            continue  # averaged by DDP, or ZeroOneAdam's local stage: each rank clips its own gradient
        agreed_steps += 1
        assert r0["local_norm"] != r1["local_norm"]
        expected = math.sqrt((r0["local_norm"] ** 2 + r1["local_norm"] ** 2) / 2)
        assert r0["clip_norm"] == r1["clip_norm"] == pytest.approx(expected, rel=1e-5)
    assert agreed_steps >= (1 if case == "zero_one_adam" else STEPS - FREEZE)


@pytest.mark.parametrize("case", list(CASES))
def test_ranks_hold_identical_params_after_synchronised_steps(runs, case):
    zero, one = runs[0][case], runs[1][case]
    assert sorted(zero["synced"]) == sorted(one["synced"])
    assert len(zero["synced"]) >= (8 if case == "zero_one_adam" else STEPS)
    for step, params in zero["synced"].items():
        assert torch.equal(params, one["synced"][step]), f"ranks differ after synchronised step {step}"
    if case == "zero_one_adam":  # the last step (14) is a local one: syncs at 8, 12, 16
        assert STEPS not in zero["synced"] and not torch.equal(zero["params"], one["params"])
    else:
        assert torch.equal(zero["params"], one["params"])


@pytest.mark.parametrize("case", list(CASES))
def test_telemetry_is_logged(runs, case):
    with open(runs[0][case]["metrics_csv"], newline="") as handle:
        rows = [r for r in csv.DictReader(handle) if r.get("comm/bytes_sent")]
    assert len(rows) == STEPS
    sent = [float(r["comm/bytes_sent"]) for r in rows]
    assert sent == [float(row["bytes_sent"]) for row in runs[0][case]["rows"]]
    assert all(float(r["comm/fp32_bytes"]) == runs[0][case]["rows"][0]["fp32_bytes"] for r in rows)
    ratios = [float(r["comm/compression_ratio"]) for r in rows if r["comm/compression_ratio"]]
    fp32 = runs[0][case]["rows"][0]["fp32_bytes"]
    assert max(ratios) > 25 and min(ratios) == pytest.approx(fp32 / (fp32 + AGREEMENT_BYTES))  # 1-bit vs DDP steps
    assert float(rows[-1]["comm/compression_ratio_total"]) == pytest.approx(
        runs[0][case]["summary"]["compression_ratio"], rel=1e-6)


def test_switch_is_stable_through_gradient_accumulation(runs):
    result = runs[0]["accumulate"]
    rows = result["rows"]  # one per micro-batch (2 per step)
    assert result["global_step"] == 8 and len(rows) == 16
    for first, second in zip(rows[::2], rows[1::2]):
        assert first["enabled"] == second["enabled"]  # both micro-batches of a window agree
    assert [r["enabled"] for r in rows[1::2]] == [True] * FREEZE + [False] * (8 - FREEZE)
    stepped = rows[1::2]
    assert all(r["bytes_sent"] == r["fp32_bytes"] + AGREEMENT_BYTES for r in stepped[:FREEZE])  # one allreduce per window
    assert all(r["bytes_sent"] < r["fp32_bytes"] / 25 for r in stepped[FREEZE:])
    assert torch.equal(runs[0]["accumulate"]["params"], runs[1]["accumulate"]["params"])


def test_auto_freeze_is_capped_at_a_share_of_the_run(runs):
    """The band rule cannot fire before its window (20 steps); the strategy knows the fit's 20 steps and caps
    the warmup at 15% of them: DDP's allreduce for 3 steps, then 1-bit, on both ranks."""
    for r in range(2):
        rows = runs[r]["auto"]["rows"]
        assert [row["ddp_allreduce"] for row in rows] == [True] * 3 + [False] * 17, r
        assert all(row["bytes_sent"] < row["fp32_bytes"] / 25 for row in rows[3:])


def test_a_onebit_optimizer_is_used_as_is(runs):
    result = runs[0]["given_onebit"]
    assert result["optimizer"] == "OnebitAdam" and result["average_grads"] is False
    assert [row["ddp_allreduce"] for row in result["rows"]] == [True] * 3 + [False] * 3  # its freeze_step=3
    assert len(result["warnings"]) == 1 and "freeze_step=3" in result["warnings"][0]
    assert runs[1]["given_onebit"]["warnings"] == []  # rank 0 warns
