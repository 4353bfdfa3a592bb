"""Save -> resume continues exactly like an uninterrupted run (bitwise, each rank), with each
rank's own error buffers (and ZeroOneAdam's per-rank state between synchronisations) in
``<ckpt>.rank<r>.pt``; on another world size the error buffers restart with one warning."""

from __future__ import annotations

import os

import pytest
import torch

from lightning_optim.lightning._base import CHECKPOINT_KEY, rank_file
from tests.distributed import run_workers
from tests.lightning.workers import CASES, RESUME_EPOCH, resume_elsewhere


@pytest.mark.parametrize("case", list(CASES))
def test_resume_is_bitwise_on_every_rank(runs, case):
    for rank in range(2):
        full, again = runs[rank][case], runs[rank][case]["resumed"]
        assert again["global_step"] == full["global_step"] == 2 * RESUME_EPOCH
        assert [r["loss"] for r in again["rows"]] == [r["loss"] for r in full["rows"][RESUME_EPOCH:]]
        assert torch.equal(again["params"], full["params"]), f"rank {rank} diverged after resuming"


@pytest.mark.parametrize("case", list(CASES))
def test_each_rank_keeps_its_own_state(runs, case):
    ckpt = runs[0][case]["ckpt"]
    assert os.path.isfile(rank_file(ckpt, 1)) and not os.path.exists(rank_file(ckpt, 0))
    main = torch.load(ckpt, map_location="cpu", weights_only=False)
    side = torch.load(rank_file(ckpt, 1), map_location="cpu", weights_only=False)
    meta = main[CHECKPOINT_KEY]
    assert meta["world_size"] == 2
    # step 7 is between two ZeroOneAdam synchronisations (local_step_interval 4 from step 8 on)
    assert meta["per_rank_params"] is (case == "zero_one_adam")
    mine, theirs = main["optimizer_states"][0]["onebit"], side["optimizer_states"][0]["onebit"]
    assert (mine["rank"], theirs["rank"]) == (0, 1)
    assert mine["worker_error"].abs().sum() > 0 and not torch.equal(mine["worker_error"], theirs["worker_error"])
    assert (side["state_dict"] is not None) is (case == "zero_one_adam")
    if case == "zero_one_adam":
        params = [k for k in main["state_dict"] if k.endswith("qkv.weight")]
        assert not torch.equal(main["state_dict"][params[0]], side["state_dict"][params[0]])


def test_without_the_rank_file_rank_1_restarts_its_error_buffers(runs):
    full = [runs[rank]["onebit_adam"] for rank in range(2)]
    lonely = [runs[rank]["no_rank_file"] for rank in range(2)]
    assert lonely[0]["warnings"] == [] and len(lonely[1]["warnings"]) == 1 and "missing" in lonely[1]["warnings"][0]
    assert torch.equal(lonely[0]["params"], lonely[1]["params"])  # the ranks still agree ...
    assert not torch.equal(lonely[0]["params"], full[0]["params"])  # ... but rank 1's residue is gone


def test_resume_on_another_world_size_warns_once(runs, tmp_path):
    ckpt = runs[0]["onebit_adam"]["ckpt"]
    (result,) = run_workers(1, resume_elsewhere, ckpt, "onebit_adam", str(tmp_path), timeout=120)
    assert len(result["warnings"]) == 1 and "saved on 2 ranks and training resumes on 1" in result["warnings"][0]
    assert result["global_step"] == 2 * RESUME_EPOCH
    losses = [row["loss"] for row in result["rows"]]
    assert len(losses) == RESUME_EPOCH and all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses) / len(losses) < runs[0]["onebit_adam"]["rows"][0]["loss"] - 0.3
