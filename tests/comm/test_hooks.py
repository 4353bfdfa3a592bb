"""Switchable DDP comm hook (2 gloo ranks) and allreduce_mean (4 ranks); worker side in workers.py."""
from __future__ import annotations

import torch

from lightning_optim.comm.stats import ring_allreduce_bytes


def test_switchable_hook_average_when_enabled_local_when_disabled(comm_spawn):
    world = 2  # DDP runs on the sub-group of ranks 0-1
    ddp = [comm_spawn[r]["ddp"] for r in range(world)]
    average = [torch.stack([d["local"][i] for d in ddp]).mean(0) for i in range(len(ddp[0]["local"]))]
    for r, d in enumerate(ddp):
        for phase, enabled in enumerate((True, True, False, True)):
            grads = d["phases"][phase]
            expected = average if enabled else d["local"]
            for got, want in zip(grads, expected):
                if enabled:
                    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
                else:
                    torch.testing.assert_close(got, want, rtol=0, atol=0)  # untouched local gradient
        assert d["reduced"] >= 3 and d["skipped"] >= 1
        # every enabled phase sends the whole model once at the ring rate, the disabled one nothing
        assert d["stats"]["bytes_sent"] == 3 * ring_allreduce_bytes(d["numel"], world)
        assert d["stats"]["full_precision_calls"] == d["reduced"]


def test_allreduce_mean_bf16_and_noncontiguous(comm_spawn):
    world = 4
    for r in range(world):
        m = comm_spawn[r]["mean"]
        assert m["bf16"].dtype == torch.bfloat16
        assert torch.equal(m["bf16"], torch.full((7,), 2.0, dtype=torch.bfloat16))  # mean of .5..3.5
        expected = (torch.arange(12, dtype=torch.float32).view(3, 4) * 2.5).t()
        torch.testing.assert_close(m["fp32"], expected)
        # the bf16 tensor went over the wire as fp32: 4 bytes per element either way
        assert m["stats"]["bytes_sent"] == ring_allreduce_bytes(7, world) + ring_allreduce_bytes(12, world)
        assert m["stats"]["full_precision_calls"] == 2
