"""CentralizedSparsifiedSGD on 2 and 3 real gloo ranks against a W-worker simulation built on the
single-worker reference (``tests/reference/centralized_sparsified.py``); one process against
SparsifiedSGD; bytes, resume and bad input (on every rank, no hang).

Tolerance: float64, 1e-12. The selections and the sums of sparse vectors are identical (same draws, same
order of addition); the one difference is the decay's rounding: the class applies ``p (1 - wd) - u`` as
torch's optimizers do, the reference ``p - (u + wd p)`` as mlbench writes it.
"""
from __future__ import annotations

import math

import pytest
import torch

from lightning_optim.distributed.sparsified import CentralizedSparsifiedSGD
from lightning_optim.optim.sparsified_sgd import SparsifiedSGD
from tests.ranks import run_ranks
from tests.distributed_optim.sparsified_workers import (
    COMMON,
    CONFIGS,
    DT,
    SHAPES,
    SPLIT,
    STEPS,
    generator_seed,
    init_params,
    rank_grads,
    suite,
)
from tests.reference.centralized_sparsified import RefCentralizedSparsifiedSGD

AGREEMENT_ROW = 10  # int64s per rank and step: an error code + the 9 agreed fields (module docstring)


@pytest.fixture(scope="module")
def spawned():
    return run_ranks(3, suite, timeout=180)


def _reference(name: str, world: int):
    kwargs = {**COMMON, **CONFIGS[name]}
    ref = RefCentralizedSparsifiedSGD(init_params(), world, generators=[
        torch.Generator().manual_seed(generator_seed(r)) for r in range(world)], **kwargs)
    history = []
    for step in range(1, STEPS + 1):
        grads = [[g if g is not None else torch.zeros(s, dtype=DT) for g, s in zip(rank_grads(step, r), SHAPES)]
                 for r in range(world)]
        ref.step(grads)
        history.append([p.clone() for p in ref.params])
    return ref, history


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_ranks_match_the_w_worker_simulation(spawned, name, world):
    results = [spawned[r]["two" if world == 2 else "three"][name] for r in range(world)]
    ref, history = _reference(name, world)
    for step in range(STEPS):
        for r in range(world):
            for got, want in zip(results[r]["history"][step], history[step]):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
            assert all(torch.equal(a, b) for a, b in zip(results[r]["history"][step], results[0]["history"][step]))
    for r in range(world):  # each rank's own error feedback
        for got, want in zip(results[r]["memories"], ref.workers[r].memory):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert not torch.equal(results[0]["memories"][0], results[1]["memories"][0])


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_bytes_per_step(spawned, name, world):
    stats = spawned[0]["two" if world == 2 else "three"][name]["stats"]
    k = COMMON["sparse_grad_size"]
    where = 8 if name == "blockwise" else 4 * k  # block start (int64) or int32 positions
    payload = STEPS * (world - 1) * len(SHAPES) * (k * 8 + where)  # float64 values
    control = stats["control_calls"] * (world - 1) * 8 * AGREEMENT_ROW
    assert stats["control_calls"] == STEPS
    assert stats["compressed_calls"] == STEPS * len(SHAPES)
    assert stats["bytes_sent"] == payload + control
    total = sum(math.prod(s) for s in SHAPES)
    assert stats["fp32_equivalent_bytes"] == STEPS * sum(2 * (world - 1) * math.prod(s) * 4 // world for s in SHAPES)
    assert total > 3 * k


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_resume_is_bitwise(spawned, name, world):
    for r in range(world):
        res = spawned[r]["two" if world == 2 else "three"][name]
        for got, want in zip(res["resumed"], res["history"][SPLIT:]):
            assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_refusals_reach_every_rank(spawned):
    for r in range(3):
        assert "sparse_grad_size (rank 0: 2, rank 1: 3, rank 2: 4)" in spawned[r]["k_differs"]
        assert "selection (" in spawned[r]["mode_differs"]
        assert spawned[r]["edited_group"].startswith("ValueError")
    assert spawned[2]["k_too_big_on_one"].startswith("ValueError: sparse_grad_size=8 exceeds the 7 elements of param 1")
    for r in (0, 1):
        assert "refused on rank 2 (sparse_grad_size)" in spawned[r]["k_too_big_on_one"]
    assert spawned[1]["world_size_on_one"].startswith("ValueError: world_size=2 must equal the number of ranks")
    for r in (0, 2):
        assert "refused on rank 1 (world_size)" in spawned[r]["world_size_on_one"]
    assert "rank 1 (sparse_grad_size)" in spawned[0]["edited_group"]
    assert "sparse_grad_size=9 exceeds" in spawned[1]["edited_group"]


@pytest.mark.parametrize("mode", [dict(), dict(random_sparse=True), dict(mode="topk")])
def test_one_process_is_sparsified_sgd(mode):
    ps = [p.requires_grad_() for p in init_params()]
    qs = [p.detach().clone().requires_grad_() for p in ps]
    a = CentralizedSparsifiedSGD(ps, **COMMON, **mode, generator=torch.Generator().manual_seed(3))
    b = SparsifiedSGD(qs, **COMMON, **mode, generator=torch.Generator().manual_seed(3))
    for step in range(1, 6):
        for p, q, g in zip(ps, qs, rank_grads(step, 0)):
            g = torch.zeros_like(p) if g is None else g
            p.grad, q.grad = g.clone(), g.clone()
        a.step()
        b.step()
        assert all(torch.equal(p, q) for p, q in zip(ps, qs))
    assert a.get_estimated_weights()[0].shape == SHAPES[0]


def _params():
    return [p.requires_grad_() for p in init_params()]


BAD = [
    ("params None", dict(params=None), ValueError, "params: required"),
    ("params empty", dict(params=[]), ValueError, "empty parameter list"),
    ("lr missing", dict(lr=None), TypeError, "lr: required"),
    ("lr negative", dict(lr=-0.1), ValueError, "lr must be in [0, inf)"),
    ("lr nan", dict(lr=float("nan")), ValueError, "lr must be finite"),
    ("lr str", dict(lr="0.1"), TypeError, "lr must be a real number"),
    ("weight_decay", dict(weight_decay=-1.0), ValueError, "weight_decay must be in [0, inf)"),
    ("k zero", dict(sparse_grad_size=0), ValueError, "sparse_grad_size must be in [1, inf)"),
    ("k negative", dict(sparse_grad_size=-3), ValueError, "sparse_grad_size must be in [1, inf)"),
    ("k float", dict(sparse_grad_size=2.5), TypeError, "sparse_grad_size must be an int"),
    ("k > numel", dict(sparse_grad_size=8), ValueError, "sparse_grad_size=8 exceeds the 7 elements of param 1"),
    ("random_sparse", dict(random_sparse="yes"), TypeError, "random_sparse must be True or False"),
    ("world_size zero", dict(world_size=0), ValueError, "world_size must be in [1, inf)"),
    ("world_size str", dict(world_size="1"), TypeError, "world_size must be an int"),
    ("world_size no group", dict(world_size=2), ValueError, "world_size=2 must equal the number of ranks"),
    ("average_world", dict(average_world=1), TypeError, "average_world must be True or False"),
    ("mode", dict(mode="best"), ValueError, "mode must be one of"),
    ("generator", dict(generator=3), TypeError, "generator must be a torch.Generator"),
    ("process_group", dict(process_group="world"), TypeError, "process_group must be None"),
]


@pytest.mark.parametrize("kwargs,error,words", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_arguments(kwargs, error, words):
    args = {"params": _params(), "lr": 0.1, "sparse_grad_size": 2, **kwargs}
    if args["lr"] is None:
        del args["lr"]
    with pytest.raises(error) as info:
        CentralizedSparsifiedSGD(**args)
    assert words in str(info.value)


def test_gradient_release_is_refused():
    from lightning_optim.optim.release import prepare_for_gradient_release

    model = torch.nn.Linear(4, 3, dtype=DT)
    opt = CentralizedSparsifiedSGD(model.parameters(), lr=0.1, sparse_grad_size=2)
    with pytest.raises(ValueError, match="gradient release is not possible: it exchanges every param"):
        prepare_for_gradient_release(model, opt)
