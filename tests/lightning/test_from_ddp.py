"""1-bit from a running job: a plain-DDP Lightning checkpoint (torch / lightning_optim AdamW)
resumes under the 1-bit strategies, the stage following from the step count; and the one warning
when a strategy's freeze step lies beyond the fit."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_workers
from tests.lightning.from_ddp_workers import freeze_beyond_the_fit, from_ddp
from tests.lightning.workers import RESUME_EPOCH


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    return run_workers(2, from_ddp, str(tmp_path_factory.mktemp("from_ddp")), timeout=300)


@pytest.mark.parametrize("key", [("onebit_adam", "torch_adamw"), ("zero_one_adam", "torch_adamw"),
                                 ("onebit_adam", "lo_adamw")])
def test_a_plain_ddp_checkpoint_resumes_in_the_compression_stage(resumed, key):
    for rank in range(2):
        run = resumed[rank][key]["resumed"]
        # the optimizer continued the saved step count (7 plain steps, freeze at 4) ...
        assert run["global_step"] == 2 * RESUME_EPOCH
        rows = run["rows"]
        assert len(rows) == RESUME_EPOCH
        if key[0] == "onebit_adam":  # ... so every resumed step was a compressed one, DDP's allreduce off
            assert not any(row["enabled"] for row in rows) and all(row["bytes_sent"] > 0 for row in rows)
        else:  # 0/1 Adam past var_freeze_step: local steps, synchronising on its schedule
            assert not any(row["enabled"] for row in rows)
        losses = torch.tensor([row["loss"] for row in rows])
        assert torch.isfinite(losses).all() and losses.mean() < 5.0  # kept training (uniform: 5.55)
        # the running LR schedule came along (the scheduler is bound to the 1-bit optimizer)
        assert run["scheduler_bound"] and run["optimizer"] in ("OnebitAdam", "ZeroOneAdam")
    assert torch.equal(resumed[0][key]["resumed"]["params"], resumed[1][key]["resumed"]["params"]) or key[0] == "zero_one_adam"


def test_freeze_step_beyond_the_fit_warns_once():
    out = run_workers(2, freeze_beyond_the_fit, "/tmp/lo_freeze_warning", timeout=300)
    for key, messages in out[0].items():
        case, steps, by_name = key.split("/")
        if steps == "3":  # freeze step 4 (or 100000 by name) is beyond a 3-step fit
            assert len(messages) == 1, (key, messages)
            expected = "100000" if by_name != "None" else "4"
            assert f"freeze_step={expected}, but this fit ends at optimizer step 3" in messages[0], messages
        else:
            assert messages == [], (key, messages)
    assert all(messages == [] for messages in out[1].values())  # rank 0 says it, once
