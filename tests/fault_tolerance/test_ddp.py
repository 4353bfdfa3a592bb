"""Per-step data parallelism on torchft (``fault_tolerant_ddp``): replicas as threads, each with its own
Manager over one Lighthouse. Without failures every replica takes the steps of one optimizer on the gradient
averaged over the replicas (computed here from the same batches); fp16/bf16 buckets come within their rounding;
a replica that joins late takes the model and optimizer state of its peers and ends with their params;
optimizers and hooks that cannot follow changing replicas are refused by name."""
from __future__ import annotations

import time

import pytest
import torch

import lightning_optim
from tests.fault_tolerance.harness import replica_threads

ft = pytest.importorskip("lightning_optim.fault_tolerance")
pytest.importorskip("torchft")

W, STEPS = 2, 6
torch.manual_seed(0)
INIT = torch.nn.Linear(5, 1).state_dict()


def _batch(replica: int, t: int):
    g = torch.Generator().manual_seed(1000 * replica + t)
    x = torch.randn(8, 5, generator=g)
    return x, x @ torch.arange(5.0)


def _model() -> torch.nn.Module:
    model = torch.nn.Linear(5, 1)
    model.load_state_dict(INIT)
    return model


def _run_replicas(fn, world: int, delays=None, lighthouse_min: int | None = None) -> list:
    return replica_threads(fn, world, lighthouse_min=lighthouse_min, delays=delays)


def _averaged_reference(steps: int):
    model = _model()
    opt = lightning_optim.AdamW(model.parameters(), lr=0.1)
    for t in range(steps):
        opt.zero_grad()
        loss = sum(((model(x).squeeze(-1) - y) ** 2).mean() for x, y in (_batch(r, t) for r in range(W))) / W
        loss.backward()
        opt.step()
    return model.weight.detach().clone()


@pytest.mark.parametrize("hook, tol", [(None, 0.0), ("fp16_compress", 1e-3), ("bf16_compress", 1e-2)])
def test_replicas_step_on_the_averaged_gradient(hook, tol):
    def replica(r, address):
        model = _model()
        manager = ft.replica_manager(replica_id=f"r{r}", min_replica_size=W, lighthouse=address, host="localhost")
        ddp, opt = ft.fault_tolerant_ddp(model, lightning_optim.AdamW(model.parameters(), lr=0.1), manager,
                                         comm_hook=hook)
        for t in range(STEPS):
            x, y = _batch(r, t)

            def closure(x=x, y=y):
                opt.zero_grad()
                loss = ((ddp(x).squeeze(-1) - y) ** 2).mean()
                loss.backward()
                return loss

            opt.step(closure)
        manager.shutdown(wait=False)
        return model.weight.detach().clone(), opt.steps_committed

    expected = _averaged_reference(STEPS)
    for weight, committed in _run_replicas(replica, W):
        assert committed == STEPS
        torch.testing.assert_close(weight, expected, rtol=tol, atol=tol)


def test_a_late_replica_takes_its_peers_state_and_ends_with_their_params():
    def replica(r, address):
        model = torch.nn.Linear(5, 1)  # its own start: a late replica takes its peers' params
        manager = ft.replica_manager(replica_id=f"r{r}", min_replica_size=1, lighthouse=address, host="localhost")
        ddp, opt = ft.fault_tolerant_ddp(model, lightning_optim.AdamW(model.parameters(), lr=0.1), manager)
        t = 0
        while manager.current_step() < 12:
            opt.zero_grad()
            x, y = _batch(r, t)
            ((ddp(x).squeeze(-1) - y) ** 2).mean().backward()
            opt.step()
            t += 1
            time.sleep(0.05)
        manager.shutdown(wait=False)
        return model.weight.detach().clone(), opt.optimizer.state_dict()["state"][0]["step"]

    (w0, s0), (w1, s1) = _run_replicas(replica, 2, delays={1: 0.3}, lighthouse_min=1)
    assert torch.equal(w0, w1)
    assert float(s0) == float(s1) == 12.0  # the late one took the AdamW step count of its peer


def test_refusals_name_the_optimizer_or_the_hook():
    model = _model()
    lighthouse = ft.local_lighthouse()
    try:
        manager = ft.replica_manager(replica_id="solo", lighthouse=lighthouse.address(), host="localhost")
        with pytest.raises(ValueError, match="OnebitAdam communicates by itself"):
            ft.fault_tolerant_ddp(model, lightning_optim.OnebitAdam(model.parameters(), lr=0.1), manager)
        diloco = lightning_optim.DiLoCo(torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2)
        with pytest.raises(ValueError, match="DiLoCo synchronises by itself"):
            ft.fault_tolerant_ddp(model, diloco, manager)
        with pytest.raises(ValueError, match="comm_hook='powersgd' cannot run on torchft's replicas"):
            ft.fault_tolerant_ddp(model, torch.optim.SGD(model.parameters(), lr=0.1), manager, comm_hook="powersgd")
        with pytest.raises(ValueError, match="comm_hook must be None, 'fp16_compress' or 'bf16_compress'"):
            ft.fault_tolerant_ddp(model, torch.optim.SGD(model.parameters(), lr=0.1), manager, comm_hook="zip")
        with pytest.raises(TypeError, match=r"optimizer must be a torch\.optim\.Optimizer"):
            ft.fault_tolerant_ddp(model, object(), manager)
        manager.shutdown(wait=False)
    finally:
        lighthouse.shutdown()
