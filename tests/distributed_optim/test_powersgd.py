"""mlbench's PowerSGD optimizer on 2 (and 3) real gloo ranks against the W-worker reference
(``tests/reference/powersgd.py``): rank 1 and 4, with and without ``reuse_query``, momentum (plain,
Nesterov, dampened), weight decay, ``by_layer``, summing; one process against torch's SGD; bytes, resume
and bad input (on every rank, no hang).

The comparison is fair: both sides draw the same queries (one generator, the documented contract) and
orthogonalise with the same modified Gram-Schmidt (column / (norm + 1e-16), then remove its projection
from the later columns). They differ only in the summation order of matrix products and of gloo's
all-reduce, so in float64 the params agree to 1e-10 after 6 steps (round-off ~1e-16 per operation,
amplified by at most the conditioning of P, which the test matrices keep small; a one-ulp change of any
input moves the result by far less, a wrong formula by ~1e-2).
"""
from __future__ import annotations

import math

import pytest
import torch

from lightning_optim.distributed.powersgd import PowerSGD
from tests.ranks import run_ranks
from tests.distributed_optim.powersgd_workers import CONFIGS, DT, SHAPES, SPLIT, STEPS, init_params, rank_grads, suite
from tests.reference.powersgd import RefPowerSGD

TOL = 1e-10
LAYOUT_ROW = 4  # int64s per rank and step: an error code + params, elements, shapes (module docstring)
COMPRESSOR_ROW = 9  # PowerSGDCompressor's first-call agreement: an error code + 8 fields
RUNS = [(name, w) for name, (_, worlds) in CONFIGS.items() for w in worlds]


@pytest.fixture(scope="module")
def spawned():
    return run_ranks(3, suite, timeout=180)


def _reference(name: str, world: int):
    kwargs = dict(CONFIGS[name][0])
    kwargs.pop("by_layer", None)  # the same result, other collectives
    average = kwargs.pop("average_world", True)
    kwargs["rank"] = kwargs.pop("matrix_approximation_rank")  # the reference keeps mlbench's name
    ref = RefPowerSGD(init_params(), world, average=average, **kwargs)
    history = []
    for step in range(1, STEPS + 1):
        ref.step([[g if g is not None else torch.zeros(s, dtype=DT) for g, s in zip(rank_grads(step, r), SHAPES)]
                  for r in range(world)])
        history.append([p.clone() for p in ref.params])
    return ref, history


@pytest.mark.parametrize("name,world", RUNS)
def test_ranks_match_the_w_worker_reference(spawned, name, world):
    results = [spawned[r][world][name] for r in range(world)]
    ref, history = _reference(name, world)
    for step in range(STEPS):
        for r in range(world):
            for got, want in zip(results[r]["history"][step], history[step]):
                torch.testing.assert_close(got, want, rtol=0, atol=TOL)
            assert all(torch.equal(a, b) for a, b in zip(results[r]["history"][step], results[0]["history"][step]))
    for r in range(world):
        for got, want in zip(results[r]["memories"], ref.memory[r]):
            torch.testing.assert_close(got, want, rtol=0, atol=TOL)
    assert (results[0]["memories"][0] - results[1]["memories"][0]).abs().max() > 1e-3  # per-rank state


def test_by_layer_is_the_same_result(spawned):
    for r in range(2):
        a, b = spawned[r][2]["r4_reuse"]["history"], spawned[r][2]["r4_reuse_by_layer"]["history"]
        for x, y in zip(a[-1], b[-1]):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-13)


def _ring(n: int, world: int, size: int = 8) -> int:
    return 2 * (world - 1) * n * size // world


@pytest.mark.parametrize("name,world", RUNS)
def test_bytes_per_step(spawned, name, world):
    rank = CONFIGS[name][0]["matrix_approximation_rank"]
    mats = [(s[0], math.prod(s[1:])) for s in SHAPES if len(s) > 1]
    p = [n * min(n, m, rank) for n, m in mats]
    q = [m * min(n, m, rank) for n, m in mats]
    vec = sum(math.prod(s) for s in SHAPES if len(s) == 1)
    if CONFIGS[name][0].get("by_layer"):  # one all-reduce of P and one of Q per matrix, one per vector
        per_step = sum(_ring(x, world) for x in p + q) + sum(_ring(math.prod(s), world) for s in SHAPES if len(s) == 1)
    else:
        per_step = _ring(sum(p), world) + _ring(sum(q), world) + _ring(vec, world)
    stats = spawned[0][world][name]["stats"]
    # control: the optimizer's layout agreement every step, and the compressor's once per layout it meets
    # (one layout, or one per param by_layer)
    first_calls = len(SHAPES) if CONFIGS[name][0].get("by_layer") else 1
    assert stats["control_calls"] == STEPS + first_calls
    control = (world - 1) * 8 * (STEPS * LAYOUT_ROW + first_calls * COMPRESSOR_ROW)
    assert stats["bytes_sent"] == STEPS * per_step + control
    total = sum(math.prod(s) for s in SHAPES)
    # ranks 1 and 2 compress these small matrices; rank 4 sends more than they hold ((n + m) r > n m)
    assert (per_step < _ring(total, world)) == (rank < 4)


@pytest.mark.parametrize("name,world", RUNS)
def test_resume_is_bitwise(spawned, name, world):
    for r in range(world):
        res = spawned[r][world][name]
        for got, want in zip(res["resumed"], res["history"][SPLIT:]):
            assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_refusals_reach_every_rank(spawned):
    for r in range(3):
        assert "matrix_approximation_rank (rank 0: 1, rank 1: 2, rank 2: 3)" in spawned[r]["rank_differs"]
        assert "seed (rank 0: 0, rank 1: 1, rank 2: 2)" in spawned[r]["seed_differs"]
        assert "params (rank 0: 3, rank 1: 4, rank 2: 3)" in spawned[r]["model_differs"]
    assert spawned[2]["rank_zero_on_one"] == "ValueError: matrix_approximation_rank must be in [1, inf), got 0"
    for r in (0, 1):
        assert "refused on rank 2 (matrix_approximation_rank)" in spawned[r]["rank_zero_on_one"]
    assert spawned[0]["world_size_on_one"].startswith("ValueError: world_size=1 must equal the number of ranks")
    for r in (1, 2):
        assert "refused on rank 0 (world_size)" in spawned[r]["world_size_on_one"]


def test_one_process_is_torch_sgd():
    """mlbench: with world_size 1 nothing is aggregated; the step is torch's SGD, bitwise."""
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 2)).to(DT)
    twin = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 2)).to(DT)
    twin.load_state_dict(model.state_dict())
    a = PowerSGD(model, lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True, matrix_approximation_rank=2,
                 use_cuda=True)
    b = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True)
    x = torch.randn(8, 5, dtype=DT, generator=torch.Generator().manual_seed(1))
    for _ in range(4):
        for m, opt in ((model, a), (twin, b)):
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))


def test_frozen_params_take_no_part():
    model = torch.nn.Linear(3, 2).to(DT)
    model.bias.requires_grad_(False)
    opt = PowerSGD(model, lr=0.1)
    assert [p for g in opt.param_groups for p in g["params"]] == [model.weight]


BAD = [
    ("model None", dict(model=None), ValueError, "model: required"),
    ("model int", dict(model=3), TypeError, "model must be an nn.Module or an iterable"),
    ("model frozen", dict(model=torch.nn.Linear(2, 2).requires_grad_(False)), ValueError, "model: has no parameter"),
    ("lr missing", dict(lr=None), TypeError, "lr: required"),
    ("lr negative", dict(lr=-1.0), ValueError, "lr must be in [0, inf)"),
    ("lr str", dict(lr="0.1"), TypeError, "lr must be a real number"),
    ("momentum", dict(momentum=-0.5), ValueError, "momentum must be in [0, inf)"),
    ("weight_decay", dict(weight_decay=float("inf")), ValueError, "weight_decay must be finite"),
    ("dampening", dict(dampening=1.5), ValueError, "dampening must be in [0, 1]"),
    ("nesterov str", dict(nesterov="yes"), TypeError, "nesterov must be True or False"),
    ("nesterov no momentum", dict(nesterov=True), ValueError, "nesterov=True needs momentum > 0"),
    ("nesterov dampening", dict(nesterov=True, momentum=0.9, dampening=0.1), ValueError, "nesterov=True needs"),
    ("average_world", dict(average_world=0), TypeError, "average_world must be True or False"),
    ("use_cuda", dict(use_cuda="cuda"), TypeError, "use_cuda must be True or False"),
    ("by_layer", dict(by_layer=None), TypeError, "by_layer must be True or False"),
    ("reuse_query", dict(reuse_query=1), TypeError, "reuse_query must be True or False"),
    ("world_size zero", dict(world_size=0), ValueError, "world_size must be in [1, inf)"),
    ("world_size float", dict(world_size=1.0), TypeError, "world_size must be an int"),
    ("world_size no group", dict(world_size=4), ValueError, "world_size=4 must equal the number of ranks"),
    ("rank zero", dict(matrix_approximation_rank=0), ValueError, "matrix_approximation_rank must be in [1, inf)"),
    ("rank negative", dict(matrix_approximation_rank=-2), ValueError, "matrix_approximation_rank must be in [1, inf)"),
    ("rank float", dict(matrix_approximation_rank=1.5), TypeError, "matrix_approximation_rank must be an int"),
    ("seed", dict(seed=-1), ValueError, "seed must be in [0, inf)"),
    ("process_group", dict(process_group=0), TypeError, "process_group must be None"),
]


@pytest.mark.parametrize("kwargs,error,words", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_arguments(kwargs, error, words):
    args = {"model": torch.nn.Linear(3, 2), "lr": 0.1, **kwargs}
    if args["lr"] is None:
        del args["lr"]
    with pytest.raises(error) as info:
        PowerSGD(**args)
    assert words in str(info.value)


def test_a_refused_state_dict_changes_nothing():
    model = torch.nn.Linear(3, 2).to(DT)
    opt = PowerSGD(model, lr=0.1, momentum=0.9, reuse_query=True)
    model(torch.ones(1, 3, dtype=DT)).sum().backward()
    opt.step()
    before = opt.state_dict()
    bad = {**before, "powersgd": {"generator": "x"}}
    with pytest.raises(ValueError, match="'generator'"):
        opt.load_state_dict(bad)
    after = opt.state_dict()
    assert torch.equal(before["powersgd"]["generator"], after["powersgd"]["generator"])
    assert all(torch.equal(before["state"][0][k], after["state"][0][k]) for k in before["state"][0])
