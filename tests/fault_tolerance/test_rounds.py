"""DiLoCo on torchft in one process: replicas as threads, each with its own Manager, over one Lighthouse.

Without failures a fault-tolerant run must be the plain run: every compressor, Streaming DiLoCo's fragments and
the overlapped merge give, step for step, the params of ``DiLoCo`` over an ordinary gloo group of the same ranks
(tests/ranks.py). A checkpoint taken
mid-run and loaded into fresh objects (new managers, which join and heal first) continues bitwise. Bad
arguments are refused before anything is built.
"""
from __future__ import annotations

import pytest
import torch

from lightning_optim.distributed.diloco import DiLoCo
from tests.fault_tolerance.harness import replica_threads
from tests.ranks import run_ranks

ft = pytest.importorskip("lightning_optim.fault_tolerance")
pytest.importorskip("torchft")

W, H, STEPS = 3, 4, 10
torch.manual_seed(0)
INIT = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 1)).state_dict()


def _model() -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 1))
    model.load_state_dict(INIT)
    return model


def _train(model, opt, replica: int, steps: range) -> None:
    for t in steps:
        g = torch.Generator().manual_seed(1000 * replica + t)
        x = torch.randn(8, 5, generator=g)
        loss = ((model(x).squeeze(-1) - x @ torch.arange(5.0)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _replicas(fn, world: int = W) -> list:
    """``fn(replica, lighthouse_address)`` on ``world`` threads; results by replica (errors re-raised)."""
    return replica_threads(fn, world)


def _manager(r: int, address: str, world: int = W):
    return ft.replica_manager(replica_id=f"r{r}", min_replica_size=world, lighthouse=address, host="localhost",
                              timeout_s=30)


SETTINGS = [
    dict(compressor=None),
    dict(compressor="int8"),
    dict(compressor="int4", fragments=2, overlap=True),
    dict(compressor="onebit", fragments=2),
    dict(compressor="sign"),
    dict(compressor="topk", overlap=True),
    dict(compressor="powersgd"),
    dict(compressor="sparseloco", density=0.3, fragments=2, overlap=True),
    dict(compressor=None, fragments=4, overlap=True, mixing=0.25),
]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_failure_free_run_equals_diloco_over_a_process_group(settings):
    def reference(rank, world):
        model = _model()
        opt = DiLoCo(torch.optim.SGD(model.parameters(), lr=0.05), sync_every=H, **settings)
        _train(model, opt, rank, range(STEPS))
        opt.finish()
        return [p.detach().clone() for p in model.parameters()]

    def replica(r, address):
        model = _model()
        manager = _manager(r, address)
        opt = DiLoCo(torch.optim.SGD(model.parameters(), lr=0.05), sync_every=H, manager=manager, **settings)
        _train(model, opt, r, range(STEPS))
        opt.finish()
        manager.shutdown(wait=False)
        return [p.detach().clone() for p in model.parameters()], opt.replicas.rounds_discarded

    expected = run_ranks(W, reference)
    got = _replicas(replica)
    for r in range(W):
        params, discarded = got[r]
        assert discarded == 0
        for p, q in zip(params, expected[r]):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)



def test_checkpoint_mid_run_continues_bitwise_in_fresh_managers():
    settings = dict(sync_every=H, fragments=2, overlap=True, compressor="int8")  # a merge in flight at the save

    def straight(r, address):
        model, manager = _model(), _manager(r, address)
        opt = DiLoCo(torch.optim.AdamW(model.parameters(), lr=0.05), manager=manager, **settings)
        _train(model, opt, r, range(STEPS))
        manager.shutdown(wait=False)
        return [p.detach().clone() for p in model.parameters()]

    def first_half(r, address):
        model, manager = _model(), _manager(r, address)
        opt = DiLoCo(torch.optim.AdamW(model.parameters(), lr=0.05), manager=manager, **settings)
        _train(model, opt, r, range(6))
        assert opt.pending is not None and manager.current_step() > 1
        saved = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "opt": opt.state_dict()}
        manager.shutdown(wait=False)
        return saved

    def second_half(r, address, saved):
        model, manager = _model(), _manager(r, address)
        model.load_state_dict(saved[r]["model"])
        opt = DiLoCo(torch.optim.AdamW(model.parameters(), lr=0.05), manager=manager, **settings)  # joins, heals
        opt.load_state_dict(saved[r]["opt"])
        assert manager.current_step() == saved[r]["opt"]["diloco"]["replicas"]["step"]
        _train(model, opt, r, range(6, STEPS))
        manager.shutdown(wait=False)
        return [p.detach().clone() for p in model.parameters()]

    expected = _replicas(straight)
    saved = _replicas(first_half)
    assert not all(torch.equal(a, b) for a, b in zip(saved[0]["model"].values(), saved[1]["model"].values()))
    got = _replicas(lambda r, address: second_half(r, address, saved))
    for r in range(W):
        for p, q in zip(got[r], expected[r]):
            assert torch.equal(p, q)


def test_a_discarded_round_rolls_sparselocos_accumulators_back():
    """Replica 1 reports a failure to its manager after its second exchange (the accumulators full since the first):
    that round is discarded there, so its accumulators, global params and params are what they were before the
    exchange (no outer step, no error feedback), while the other replicas commit it."""
    settings = dict(sync_every=H, compressor="sparseloco", density=0.3, outer_lr=1.0, outer_momentum=0.9)

    class FailsOnce(DiLoCo):
        fails = False

        def _exchange(self, fragment, t, final, group, zero=False):
            exchange = super()._exchange(fragment, t, final, group, zero)
            if self.fails and t == 2 * H:
                self.replicas.manager.report_error(RuntimeError("injected: replica 1's link fails after sending"))
            return exchange

    def replica(r, address):
        model, manager = _model(), _manager(r, address)
        opt = FailsOnce(torch.optim.SGD(model.parameters(), lr=0.05), manager=manager, **settings)
        opt.fails = r == 1
        _train(model, opt, r, range(2 * H - 1))
        before = {"residuals": [e.clone() for e in opt.residuals], "global": [g.clone() for g in opt.global_params]}
        _train(model, opt, r, range(2 * H - 1, 2 * H))
        after = {"residuals": [e.clone() for e in opt.residuals], "global": [g.clone() for g in opt.global_params],
                 "params": [p.detach().clone() for p in model.parameters()], "discarded": opt.replicas.rounds_discarded}
        manager.shutdown(wait=False)
        return before, after

    got = _replicas(replica)
    for r, (before, after) in enumerate(got):
        assert any(e.abs().sum() > 0 for e in before["residuals"])  # filled by the first exchange
        kept = [torch.equal(a, b) for a, b in zip(before["residuals"], after["residuals"])]
        stayed = [torch.equal(a, b) for a, b in zip(before["global"], after["global"])]
        if r == 1:
            assert after["discarded"] == 1 and all(kept) and all(stayed)
            assert not all(torch.equal(p, g) for p, g in zip(after["params"], after["global"]))  # its own params
        else:
            assert after["discarded"] == 0 and not all(kept) and not any(stayed)
            assert all(torch.equal(p, g) for p, g in zip(after["params"], after["global"]))


def test_refusals_name_the_argument_before_anything_is_built():
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)

    class NotAManager:
        pass

    with pytest.raises(TypeError, match=r"manager must be a torchft\.Manager"):
        DiLoCo(inner, sync_every=2, manager=NotAManager())
    lighthouse = ft.local_lighthouse()
    try:
        manager = ft.replica_manager(replica_id="solo", lighthouse=lighthouse.address(), host="localhost")
        with pytest.raises(ValueError, match="process_group and manager exclude each other"):
            DiLoCo(inner, sync_every=2, manager=manager, process_group=manager._pg)
        manager.shutdown(wait=False)
    finally:
        lighthouse.shutdown()
    with pytest.raises(ValueError, match="replica_id must be a non-empty string"):
        ft.replica_manager(replica_id="", lighthouse="http://localhost:1")
    with pytest.raises(ValueError, match="min_replica_size must be"):
        ft.replica_manager(replica_id="a", min_replica_size=0, lighthouse="http://localhost:1")
    with pytest.raises(ValueError, match="lighthouse: give the Lighthouse's address"):
        ft.replica_manager(replica_id="a", lighthouse="")
    with pytest.raises(ValueError, match="min_replicas must be"):
        ft.local_lighthouse(min_replicas=0)


def test_a_bug_in_the_exchange_propagates_instead_of_discarding_rounds():
    class Broken(DiLoCo):
        def _exchange(self, fragment, t, final, group, zero=False):
            raise TypeError("a bug, not a failed link")

    def replica(r, address):
        model, manager = _model(), _manager(r, address, world=1)
        opt = Broken(torch.optim.SGD(model.parameters(), lr=0.05), sync_every=2, manager=manager)
        try:
            with pytest.raises(TypeError, match="a bug, not a failed link"):
                _train(model, opt, r, range(2))
        finally:
            manager.shutdown(wait=False)
        return opt.replicas.rounds_discarded

    assert _replicas(replica, world=1) == [0]
