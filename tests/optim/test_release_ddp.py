"""Gradient release under DDP on 2 and 3 real gloo ranks equals plain DDP + the same optimizer,
bitwise on CPU (the hook averages like DDP, ``g * (1/world)`` then a sum all-reduce, and the
per-param update is the same element-wise math as the bucketed step), with gradient accumulation
(``no_sync``), an LR scheduler and a mid-run reload of the optimizer state."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_workers  # processes: the release hook steps in a gloo callback thread
from tests.optim import release_ddp_workers as workers


@pytest.mark.parametrize("world,name,accumulate", [(2, "AdamW", 1), (3, "AdamW", 2), (2, "SGD", 3)])
def test_release_in_ddp_hook_equals_plain_ddp(world, name, accumulate):
    results = run_workers(world, workers.release_vs_ddp, name, 6, accumulate, timeout=120)
    for rank, res in enumerate(results):
        for a, b in zip(res["ddp"], res["release"]):
            assert torch.equal(a, b), f"rank {rank}: release differs from DDP by {(a - b).abs().max()}"
        assert res["buckets_stepped"] > 6  # several buckets per synced backward
        assert res["grads_left"] == 0  # zero_grad dropped the grads DDP wrote back after the hook
    for res in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0]["release"], res["release"]))


def test_release_without_zero_grad_stays_equal_to_ddp():
    results = run_workers(2, workers.release_without_zero_grad, timeout=120)
    for res in results:
        for a, b in zip(res["ddp"], res["release"]):
            assert torch.equal(a, b)
