"""1-bit Adam's exchange overlapped with backward: the DDP comm hook that compresses
each unit of momenta on a communication thread as soon as DDP has its gradients gives the same params,
bit for bit, as the same units compressed at step() time, through the warmup -> compression switch and
after a resume from a compression-stage checkpoint (under a fresh DDP, whose buckets differ until it
rebuilds them), on 2 ranks launched by torchrun."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import lightning_optim
from lightning_optim.onebit import overlap_with_ddp
from lightning_optim.onebit.units import cut_units
from tests.distributed import torchrun_results

ROOT = Path(__file__).resolve().parents[2]


def test_overlapped_equals_step_time_units_over_the_switch_and_a_resume(tmp_path):
    results = torchrun_results(ROOT / "tests/onebit/overlap_ddp.py", tmp_path, cwd=ROOT)
    for rank, res in enumerate(results):
        assert res["units"] == 3  # the test model cut into several units
        assert res["overlapped_buckets"] == 3 * 5 and res["sequential_buckets"] == 0  # 5 compression steps
        for step, (a, b) in enumerate(zip(res["overlapped"], res["sequential"]), 1):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), f"rank {rank}, step {step}"
        for step, (a, b) in enumerate(zip(res["resumed"], res["overlapped"][5:]), 6):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), f"rank {rank}, resumed step {step}"
        # the params moved in the compression stage (not a frozen no-op)
        assert not all(torch.equal(x, y) for x, y in zip(res["overlapped"][-1], res["overlapped"][3]))
    for a, b in zip(results[0]["overlapped"][-1], results[1]["overlapped"][-1]):
        assert torch.equal(a, b)  # every rank ends with the same params


def test_units_cut_last_to_first_under_the_cap():
    assert cut_units([4, 4, 4, 10, 1], cap=8) == [(4,), (3,), (1, 2), (0,)]
    assert cut_units([3, 3, 3], cap=100) == [(0, 1, 2)]
    assert cut_units([], cap=8) == []


@pytest.mark.parametrize("make,kwargs,match", [
    (lambda p: torch.optim.AdamW(p), {}, "drives OnebitAdam"),
    (lambda p: lightning_optim.OnebitAdam(p), {}, "average_grads=False"),
    (lambda p: lightning_optim.OnebitAdam(p, average_grads=False), {"overlap": 1}, "overlap must be True or False"),
    (lambda p: lightning_optim.OnebitAdam(p, average_grads=False), {"unit_mb": 0}, "unit_mb must be a positive"),
    (lambda p: lightning_optim.OnebitAdam([{"params": p[:1]}, {"params": p[1:], "betas": (0.8, 0.999)}],
                                          average_grads=False), {}, "one beta1 for every param group"),
])
def test_bad_arguments_are_refused_before_any_hook(make, kwargs, match):
    params = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2))]

    class NotDDP(torch.nn.Module):  # DDP's attributes the checks read; registering must not happen
        bucket_bytes_cap = 1 << 20

        def __init__(self):
            super().__init__()
            self.module = torch.nn.ParameterList(params)

        def register_comm_hook(self, *a):
            raise AssertionError("registered despite a bad argument")

    with pytest.raises(ValueError, match=match):
        overlap_with_ddp(NotDDP(), make(params), **kwargs)


def test_an_optimizer_that_misses_model_params_is_refused():
    params = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2))]
    module = torch.nn.ParameterList(params)
    opt = lightning_optim.OnebitAdam(params[:1], average_grads=False)
    with pytest.raises(ValueError, match=r"does not train 1 of the DDP model's params \(1\)"):
        lightning_optim.onebit.overlap.check_trains_ddp_params(module, opt)


def test_set_compression_units_checks_its_cap():
    opt = lightning_optim.OnebitAdam([torch.nn.Parameter(torch.randn(3))])
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="cap must be a positive number"):
            opt.set_compression_units(bad)
