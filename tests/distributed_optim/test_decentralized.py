"""DecentralizedSGD (mlbench's API) on real gloo ranks against the W-worker reference
(tests/reference/decentralized.py): every rank's params and momentum, pure-gossip rate, the quadratic's
fixed point, bytes, resume bitwise, and a sweep of every constructor argument."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_optim.comm.stats import ring_allreduce_bytes
from lightning_optim.distributed.decentralized import DecentralizedSGD
from tests.ranks import run_ranks
from tests.distributed_optim import decentralized_workers as dw
from tests.reference import decentralized as ref

STEPS = 6
IRREGULAR = [[1, 2, 3], [0, 2], [0, 1], [0]]
PATH4 = [[1], [0, 2], [1, 3], [2]]
PATH3 = [[1], [0, 2], [1]]
CASES_4 = [  # (label, neighbors spec, kwargs, reference graph, weights)
    ("ring", ("plain", None), dict(lr=0.1, momentum=0.9, nesterov=True), ref.ring_neighbors(4), "uniform"),
    ("torus", ("plain", "torus:2x2"), dict(lr=0.05, momentum=0.5, dampening=0.1, weight_decay=0.01, by_layer=True),
     ref.torus_neighbors(2, 2), "uniform"),
    ("exponential", ("plain", "exponential"), dict(lr=0.2), ref.exponential_neighbors(4), "uniform"),
    ("own_list", ("own", IRREGULAR), dict(lr=0.1, momentum=0.9, rank="<rank>"), IRREGULAR, "uniform"),
    ("full_lists", ("plain", PATH4), dict(lr=0.1, weight_decay=0.1, by_layer=True), PATH4, "uniform"),
    ("metropolis", ("topology", (IRREGULAR, "metropolis")), dict(lr=0.1, momentum=0.8), IRREGULAR, "metropolis"),
]
CASES_3 = [
    ("ring", ("plain", None), dict(lr=0.1, momentum=0.9), ref.ring_neighbors(3), "uniform"),
    ("own_list", ("own", PATH3), dict(lr=0.1, momentum=0.9, nesterov=True, by_layer=True), PATH3, "uniform"),
]


def _worker_cases(cases):
    return [(label, spec, kwargs) for label, spec, kwargs, _, _ in cases]


@pytest.fixture(scope="module")
def four_ranks():
    calls = [("runs", "runs", (_worker_cases(CASES_4), STEPS)),
             ("pure_gossip", "pure_gossip", (12,)),
             ("quadratic", "quadratic", (0.3, 80)),
             ("bytes_flat", "bytes_per_step", (False,)),
             ("bytes_by_layer", "bytes_per_step", (True,))]
    return run_ranks(4, dw.several, calls, timeout=240)


@pytest.fixture(scope="module")
def three_ranks():
    calls = [("runs", "runs", (_worker_cases(CASES_3), STEPS)),
             ("resume", "resume", (dict(lr=0.1, momentum=0.9, nesterov=True, by_layer=True), 6, 3))]
    return run_ranks(3, dw.several, calls, timeout=180)


def _reference(world, neighbors, weights, kwargs):
    kwargs = {k: v for k, v in kwargs.items() if k not in ("by_layer", "rank")}
    params = [list(dw.model(r).parameters()) for r in range(world)]
    sim = ref.DecentralizedSGDReference(params, ref.mixing_matrix(neighbors, weights), **kwargs)
    for step in range(STEPS):
        sim.step([dw.grads(r, step, params[r]) for r in range(world)])
    return sim


def _check(results, cases, world):
    for label, _, kwargs, neighbors, weights in cases:
        sim = _reference(world, neighbors, weights, kwargs)
        for rank in range(world):
            got = results[rank]["runs"][label]
            assert got["neighbors"] == neighbors[rank], label
            # float64 on both sides; the local step and the mix associate differently: a few ulps per step
            for a, b in zip(got["params"], sim.xs[rank]):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=f"{label} rank {rank}")
            if kwargs.get("momentum"):
                for a, b in zip(got["momentum"], sim.buffers[rank]):
                    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=f"{label} momentum rank {rank}")


def test_every_rank_equals_the_reference_on_4_ranks(four_ranks):
    _check(four_ranks, CASES_4, 4)


def test_every_rank_equals_the_reference_on_3_ranks(three_ranks):
    _check(three_ranks, CASES_3, 3)


def test_pure_gossip_shrinks_consensus_by_the_second_eigenvalue(four_ranks):
    lam = ref.second_eigenvalue_modulus(ref.mixing_matrix(ref.ring_neighbors(4)))
    dists = four_ranks[0]["pure_gossip"]
    assert dists[0] > 0.1
    assert [b / a for a, b in zip(dists, dists[1:])] == pytest.approx([lam] * (len(dists) - 1), rel=1e-6)
    assert all(four_ranks[r]["pure_gossip"] == dists for r in range(4))


def test_sgd_on_quadratics_reaches_the_mean_of_the_centres(four_ranks):
    lr = 0.3
    c = torch.stack([four_ranks[r]["quadratic"]["c"] for r in range(4)])
    x = torch.stack([four_ranks[r]["quadratic"]["x"] for r in range(4)])
    torch.testing.assert_close(x.mean(0), c.mean(0), rtol=0, atol=1e-9)
    # each rank sits at the fixed point of x <- M ((1 - lr) x + lr c): x* = lr (I - (1 - lr) M)^-1 M c
    m = ref.mixing_matrix(ref.ring_neighbors(4))
    fixed = lr * torch.linalg.solve(torch.eye(4, dtype=torch.float64) - (1 - lr) * m, m @ c)
    torch.testing.assert_close(x, fixed, rtol=0, atol=1e-9)
    assert (x - c.mean(0)).abs().max() > 1e-3  # the ranks do not all sit at the mean: gossip, not allreduce


def test_bytes_per_step_are_degree_times_numel_times_4(four_ranks):
    params = list(dw.model(0, torch.float32).parameters())
    numel = sum(p.numel() for p in params)
    for rank in range(4):
        for label, fp32 in (("bytes_flat", ring_allreduce_bytes(numel, 4)),
                            ("bytes_by_layer", sum(ring_allreduce_bytes(p.numel(), 4) for p in params))):
            assert four_ranks[rank][label] == [(2 * numel * 4, fp32, 0)] * 3, label


def test_resume_is_bitwise_and_a_wrong_rank_state_is_refused_everywhere(three_ranks):
    for rank in range(3):
        got = three_ranks[rank]["resume"]
        assert all(torch.equal(a, b) for a, b in zip(got["straight"], got["resumed"])), rank
        assert got["saved_rank"] == rank and got["untouched"], rank
        if rank == 1:
            assert "saved by rank 2 of 3, loaded on rank 1" in got["refused"]
        else:
            assert "rank(s) [1] refused" in got["refused"], got["refused"]
    # momentum is per rank: each rank saved its own
    momenta = [three_ranks[r]["resume"]["saved_momentum"][0] for r in range(3)]
    assert not torch.equal(momenta[0], momenta[1]) and not torch.equal(momenta[1], momenta[2])


def _all(**kw):
    return [dict({"model": "<model>", "lr": 0.1}, **kw)] * 3


def _per_rank(*kws):
    return [dict({"model": "<model>", "lr": 0.1}, **kw) for kw in kws]


BAD = [  # (label, kwargs per rank, words in every rank's message, same message on every rank)
    ("rank_wrong", _all(rank=0), "rank=0", True),
    ("rank_type", _per_rank(dict(rank=0), dict(rank="1"), dict(rank=2)), "rank='1'", True),
    ("rank_negative", _per_rank(dict(rank=0), dict(rank=1), dict(rank=-2)), "rank=-2", True),
    ("neighbors_asymmetric", _per_rank(dict(neighbors=[1]), dict(neighbors=[0, 2]), dict(neighbors=[0, 1])),
     "not symmetric", True),
    ("neighbors_missing_rank", _per_rank(dict(neighbors=[1, 3]), dict(neighbors=[0, 2]), dict(neighbors=[1])),
     "not in the group", True),
    ("neighbors_self", _all(neighbors=[0, 1, 2]), "itself", True),
    ("neighbors_duplicate", _per_rank(dict(neighbors=[1]), dict(neighbors=[0, 2, 2]), dict(neighbors=[1])),
     "twice", True),
    ("neighbors_differ", _per_rank(dict(neighbors=PATH3), dict(neighbors=[[1, 2], [0, 2], [0, 1]]),
                                   dict(neighbors=PATH3)), "different topologies", True),
    ("neighbors_disconnected", _per_rank(dict(neighbors=[1]), dict(neighbors=[0]), dict(neighbors=[])),
     "not connected", True),
    ("neighbors_name", _all(neighbors="star"), "unknown topology name 'star'", True),
    ("neighbors_type", _all(neighbors={1, 2}), "got set", True),
    ("neighbors_full_length", _all(neighbors=[[1], [0]]), "one list per rank", True),
    ("neighbors_topology_size", _all(neighbors="<topology of 2>"), "the Topology has 2 ranks", True),
    ("model_none", _all(model=None), "model must be a torch.nn.Module", True),
    ("model_type", _all(model="net"), "model must be a torch.nn.Module", True),
    ("model_no_params", _all(model="<no-params>"), "model has no parameters", True),
    ("model_layout_differs", _all(model="<model-other-layout-on-1>"),
     "parameter layout (count, shapes, dtypes) differs across ranks (ranks grouped by value: [[0, 2], [1]])", True),
    ("lr_missing", [{"model": "<model>"}] * 3, "lr is required", True),
    ("lr_negative", _all(lr=-0.1), "lr must be in [0, inf)", True),
    ("lr_nan", _all(lr=math.nan), "lr must be finite", True),
    ("lr_type", _all(lr="0.1"), "lr must be a real number", True),
    ("lr_on_one_rank", _per_rank({}, dict(lr=-1.0), {}), "lr", False),
    ("momentum", _all(momentum=-0.5), "momentum must be in [0, inf)", True),
    ("dampening", _all(momentum=0.9, dampening=1.5), "dampening must be in [0, 1]", True),
    ("weight_decay", _all(weight_decay=-1), "weight_decay must be in [0, inf)", True),
    ("nesterov_type", _all(momentum=0.9, nesterov="yes"), "nesterov must be True or False", True),
    ("nesterov_without_momentum", _all(nesterov=True), "nesterov: needs momentum > 0", True),
    ("average_world_false", _all(average_world=False), "average_world must be True", True),
    ("average_world_type", _all(average_world="True"), "average_world must be True or False", True),
    ("use_cuda_type", _all(use_cuda="no"), "use_cuda must be True or False", True),
    ("by_layer_type", _all(by_layer=1), "by_layer must be True or False", True),
    ("by_layer_differs", _per_rank(dict(by_layer=True), {}, {}), "by_layer differs across ranks", True),
]


def test_every_bad_argument_raises_on_every_rank_without_a_hang():
    cases = [(label, kwargs) for label, kwargs, _, _ in BAD]
    results = run_ranks(3, dw.bad_arguments, cases, timeout=120)  # each check is bounded by 10 s; none waits
    for label, _, words, same in BAD:
        raised = [results[r][label] for r in range(3)]
        assert all(raised), (label, raised)
        assert all(kind in ("TypeError", "ValueError", "TopologyError") for kind, _ in raised), (label, raised)
        assert all(words in message for _, message in raised), (label, raised)
        if same:
            assert len(set(raised)) == 1, (label, raised)
    one = [results[r]["lr_on_one_rank"][1] for r in range(3)]
    assert "lr must be in [0, inf)" in one[1]
    assert "rank 1 refused its argument 'lr'" in one[0] and one[0] == one[2]


# ---------------------------------------------------------------- one process (no process group)
def test_one_process_is_our_sgd_bitwise_and_torch_sgd_closely():
    """With one rank there is nobody to gossip with: the step is lightning_optim.SGD's (bitwise), which
    follows torch.optim.SGD up to its compiled kernel's rounding."""
    from lightning_optim import SGD

    torch.manual_seed(0)
    nets = [nn.Linear(5, 3) for _ in range(3)]
    for twin in nets[1:]:
        twin.load_state_dict(nets[0].state_dict())
    hyper = dict(lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True)
    opts = [DecentralizedSGD(model=nets[0], use_cuda=True, **hyper), SGD(nets[1].parameters(), **hyper),
            torch.optim.SGD(nets[2].parameters(), **hyper)]
    assert opts[0].neighbors == [] and opts[0].rank == 0
    for step in range(5):
        x = torch.randn(4, 5)
        for net, opt in zip(nets, opts):
            opt.zero_grad()
            net(x).square().sum().backward()
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(nets[0].parameters(), nets[1].parameters()))
    for a, b in zip(nets[0].parameters(), nets[2].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    restored = DecentralizedSGD(model=nn.Linear(5, 3), **hyper)
    restored.load_rank_state_dict(opts[0].rank_state_dict())
    assert all(torch.equal(a, b) for a, b in zip(restored.model.parameters(), nets[0].parameters()))
    for p, q in zip(restored.model.parameters(), nets[0].parameters()):
        assert torch.equal(restored.state[p]["momentum_buffer"], opts[0].state[q]["momentum_buffer"])


def test_one_process_refuses_accumulation_release_and_tracks():
    opt = DecentralizedSGD(model=nn.Linear(2, 1), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="optimizer_accumulation"):
        opt.optimizer_accumulation = True
    from lightning_optim.optim.release import prepare_for_gradient_release

    with pytest.raises(ValueError, match="DecentralizedSGD"):
        prepare_for_gradient_release(opt.model, opt)
    calls = []

    class Tracker:
        def record_batch_opt_step(self):
            calls.append("opt_step")

        def record_batch_agg(self):
            calls.append("agg")

    opt.step(tracker=Tracker())
    assert calls == ["opt_step", "agg"]
    with pytest.raises(ValueError, match="saved by rank 3"):
        opt.load_rank_state_dict(dict(opt.rank_state_dict(), rank=3))
