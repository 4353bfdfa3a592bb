"""``enable_onebit`` with the user's own 1-bit optimizer (``OnebitAdam(model.parameters(), ...)``,
``average_grads=True`` by default), under one real ``torchrun --nproc_per_node 2`` Accelerate run (gloo,
CPU) for all three classes: before the first step it is handed to DDP's averaging and trains exactly as the
documented ``to_onebit_optimizer`` route (same params bitwise, same bytes every step, past the freeze
step); after a step it is refused by name with nothing changed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")

from tests.distributed import torchrun_results  # noqa: E402

SCRIPT = Path(__file__).with_name("own_optimizer_script.py")
REPO = Path(__file__).resolve().parents[2]
CASES = ["onebit_adam", "zero_one_adam", "onebit_lamb"]
FREEZE = 3


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    results = torchrun_results(SCRIPT, tmp_path_factory.mktemp("own"), cwd=REPO)
    assert [r["world"] for r in results] == [2, 2]
    return results


@pytest.mark.parametrize("case", CASES)
def test_the_own_optimizer_trains_as_the_converted_one(ranks, case):
    for result in ranks:
        own, converted = result[case]["own"], result[case]["converted"]
        assert own["hyper_parameters"] == converted["hyper_parameters"]  # the two routes build the same optimizer
        assert (own["average_grads"], own["average_grads_after"], converted["average_grads"]) == (True, False, False)
        assert own["global_step"] == len(own["rows"]) > FREEZE
        for a, b in zip(own["params"], converted["params"]):
            assert torch.equal(a, b)
        assert [r["bytes"] for r in own["rows"]] == [r["bytes"] for r in converted["rows"]]
        assert [r["ddp_allreduce"] for r in own["rows"]] == [s < FREEZE for s in range(len(own["rows"]))]
    for a, b in zip(ranks[0][case]["own"]["params"], ranks[1][case]["own"]["params"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", CASES)
def test_warmup_sends_one_fp32_allreduce_and_the_1bit_steps_compress(ranks, case):
    own = ranks[0][case]["own"]
    fp32_ring = 4 * own["numel"]  # DDP's fp32 ring allreduce on 2 ranks: 2 (W-1)/W * 4 bytes per element
    warm, compressed = [r["bytes"] for r in own["rows"][:FREEZE]], [r["bytes"] for r in own["rows"][FREEZE:]]
    # an optimizer left averaging itself would send a second fp32 allreduce beside DDP's in warmup
    assert all(abs(b - fp32_ring) < 0.01 * fp32_ring for b in warm), (warm, fp32_ring)
    assert all(20 < fp32_ring / b <= 32.5 for b in compressed), (compressed, fp32_ring)


@pytest.mark.parametrize("case", CASES)
def test_after_a_step_it_is_refused_and_nothing_changes(ranks, case):
    for result in ranks:
        refused = result[case]["refused"]
        assert refused["message"].startswith("ValueError: optimizer: this "), refused["message"]
        assert "average_grads=True and has already stepped" in refused["message"]
        assert "before the first step" in refused["message"]
        assert refused["average_grads"] is True and refused["managed"] is False
        assert refused["comm_hooks"] == 0 and refused["clip_replaced"] is False
