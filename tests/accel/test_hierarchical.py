"""Hierarchical 1-bit Adam through Accelerate (enable_onebit, 4 gloo ranks as 2 nodes of 2) and the HF route's
``optim_args``: DDP's warmup average goes through the node hierarchy, and the run equals the optimizer averaging
by itself, bitwise."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from accel_plugins.hf import TrainingArguments, optimizer_cls_and_kwargs  # noqa: E402
from lightning_optim import OnebitAdam  # noqa: E402
from tests.accel.hierarchical_workers import FREEZE, accelerate_run, plain_run  # noqa: E402
from tests.distributed import run_workers  # noqa: E402


def test_enable_onebit_averages_through_the_nodes_and_equals_the_optimizer_alone():
    ours = run_workers(4, accelerate_run, timeout=300)
    alone = run_workers(4, plain_run, timeout=300)
    for r in range(4):
        for p, q in zip(ours[r]["params"], alone[r]):
            assert torch.equal(p, q), r
        for step, row in enumerate(ours[r]["steps"], start=1):
            assert row["intra"] > 0, (r, step)  # warmup and compression both reduce inside the node first
        warm, compressed = ours[r]["steps"][FREEZE - 1], ours[r]["steps"][-1]
        assert compressed["ddp"] == warm["ddp"]  # no DDP average after the switch
        assert compressed["inter"] * 10 < warm["inter"]  # 1-bit across nodes instead of fp32


def test_the_hf_route_takes_hierarchical_from_optim_args():
    args = TrainingArguments("/tmp/unused", optim="onebit_adam", optim_args="freeze_step=5,hierarchical=True",
                             report_to=[], use_cpu=True)
    cls, kwargs = optimizer_cls_and_kwargs(args)
    assert cls is OnebitAdam and kwargs["hierarchical"] is True and kwargs["freeze_step"] == 5
    args = TrainingArguments("/tmp/unused", optim="onebit_adam", optim_args="hierarchical=4", report_to=[],
                             use_cpu=True)
    assert optimizer_cls_and_kwargs(args)[1]["hierarchical"] == 4
    with pytest.raises(ValueError, match="hierarchical"):
        TrainingArguments("/tmp/unused", optim="onebit_adam", optim_args="hierarchical=0", report_to=[], use_cpu=True)
