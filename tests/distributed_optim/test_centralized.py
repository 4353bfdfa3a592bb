"""mlbench's centralized optimizers on real gloo ranks against the W-worker reference
(tests/reference/centralized.py), plus resume, LR schedulers, byte counts and training.

Tolerances: float64 runs differ from the float64 reference only by the order of the sums (gloo's
ring vs the reference's loop) and of the optimizers' arithmetic: ~1e-16 relative per operation,
so 1e-10 leaves room over 4 steps and Adam's division by sqrt(v). fp32: 1e-5 (fp32 rounding,
2^-24, over a few operations per step). bf16: each step rounds params and gradients to bf16
(2^-9 relative), so 2e-2.
"""

from __future__ import annotations

import io

import pytest
import torch

from lightning_optim.comm.stats import ring_allreduce_bytes
from tests.ranks import run_ranks
from tests.distributed_optim import centralized_workers as cw
from tests.reference import RefAdam
from tests.reference.centralized import RefCentralized, RefSGD, TorchLocal

TOLERANCE = {torch.float64: dict(rtol=1e-10, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-6),
             torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


_RUNS: dict[int, list] = {}


def _runs(world: int) -> list:
    """Every spec on ``world`` gloo ranks, run once per test session."""
    if world not in _RUNS:
        _RUNS[world] = run_ranks(world, cw.run_specs, list(cw.SPECS), timeout=180)
    return _RUNS[world]


@pytest.fixture(scope="module", params=[2, 3], ids=["W2", "W3"])
def runs(request):
    return request.param, _runs(request.param)


def _dtype(name):
    return cw.SPECS[name][4].get("dtype", torch.float64)


def _reference(name: str, world: int) -> RefCentralized:
    kind, local, local_kw, flags, _ = cw.SPECS[name]
    dtype = _dtype(name)

    def make_local(ps):
        if kind == "sgd":
            return RefSGD(ps, **local_kw)
        if kind == "adam":
            return RefAdam(ps, **local_kw)
        return TorchLocal(ps, getattr(torch.optim, local), **local_kw)

    average = ("world" if kind != "custom" or flags.get("average_world") else
               "custom" if flags.get("average_custom") else "sum")
    starts = [[p.to(dtype).double() for p in cw.initial_params(cw.init_seed(name, r))] for r in range(world)]
    return RefCentralized(starts[0], world, make_local, agg_grad=flags.get("agg_grad", True),
                          divide_before=flags.get("divide_before", False), average=average,
                          grad_clip=flags.get("grad_clip", float("inf")), worker_params=starts)


def _reference_run(name: str, world: int):
    """Per step: the params of worker 0 and the aggregated gradients (None for weight averaging)."""
    ref, dtype = _reference(name, world), _dtype(name)
    lr0 = ref.lr
    params, aggs = [], []
    for step in range(1, cw.STEPS + 1):
        if cw.SPECS[name][4].get("scheduler"):
            ref.lr = lr0 * 0.5 ** ((step - 1) // 2)  # StepLR(step_size=2, gamma=0.5)
        grads = [[None if g is None else g.to(dtype).double() for g in cw.rank_grads(name, step, r)]
                 for r in range(world)]
        denom = cw.denom_at(step) if cw.SPECS[name][3].get("average_custom") else None
        aggs.append(ref.aggregate(grads, denom) if ref.agg_grad else None)
        ref.step(grads, denom)
        params.append([p.clone() for p in ref.workers[0]])
    return params, aggs


def _close(got, want, dtype):
    assert (got is None) == (want is None)
    if want is not None:
        torch.testing.assert_close(got.double(), want, **TOLERANCE[dtype])


@pytest.mark.parametrize("name", list(cw.SPECS))
def test_matches_the_w_worker_reference(runs, name):
    world, results = runs
    want_params, want_aggs = _reference_run(name, world)
    for rank, out in enumerate(results):
        for by_layer in (False, True):
            got = out[name, by_layer]
            for step in range(cw.STEPS):
                for p_got, p_want in zip(got["params"][step], want_params[step]):
                    _close(p_got, p_want, _dtype(name))
                if want_aggs[step] is not None:  # the gradients the local step saw = the aggregate
                    for g_got, g_want in zip(got["grads"][step], want_aggs[step]):
                        _close(g_got, g_want, _dtype(name))


@pytest.mark.parametrize("name", list(cw.SPECS))
def test_ranks_hold_the_same_params_after_every_step(runs, name):
    world, results = runs
    for by_layer in (False, True):
        first = results[0][name, by_layer]["params"]
        for out in results[1:]:
            for a, b in zip(first, out[name, by_layer]["params"]):
                assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_flat_and_by_layer_agree(runs):
    """Two ranks: a + b is one rounding whatever the chunking, so flat == by layer bitwise. Three
    ranks: gloo's ring adds the three in an order that depends on an element's place in the buffer,
    so the layouts may differ in the last bit (float64: far inside the tolerance)."""
    world, results = runs
    for name in cw.SPECS:
        flat, layer = results[0][name, False]["params"], results[0][name, True]["params"]
        for a, b in zip(flat, layer):
            for x, y in zip(a, b):
                if world == 2:
                    assert torch.equal(x, y), name
                else:
                    torch.testing.assert_close(x, y, **TOLERANCE[_dtype(name)])


@pytest.mark.parametrize("name", ["custom_denom", "custom_denom_before"])
def test_divide_before_or_after_is_the_one_asked_for(name):
    """Two ranks, no clipping: the aggregate is one addition and one or two roundings of a division,
    so it equals the reference bitwise; dividing by 2.5 + t is inexact, so the other order differs
    somewhere (this is how divide_before shows, beyond the tolerance of the other tests)."""
    results = _runs(2)  # bitwise only with two ranks (three summands: gloo's order is not the reference's)
    before = cw.SPECS[name][3].get("divide_before", False)
    for by_layer in (False, True):
        got = results[0][name, by_layer]["grads"]
        for step in range(1, cw.STEPS + 1):
            a, b = cw.rank_grads(name, step, 0), cw.rank_grads(name, step, 1)
            d = cw.denom_at(step)
            asked = [x / d + y / d if before else (x + y) / d for x, y in zip(a, b)]
            other = [(x + y) / d if before else x / d + y / d for x, y in zip(a, b)]
            assert all(torch.equal(g, w) for g, w in zip(got[step - 1], asked))
            assert any(not torch.equal(g, o) for g, o in zip(got[step - 1], other))


def test_missing_gradients(runs):
    """Param 3 has a gradient on no rank: it keeps grad None and never moves (momentum and weight
    decay would move it otherwise); param 1, missing on rank 0 only, gets the aggregate everywhere."""
    world, results = runs
    start = cw.initial_params(0)[3]
    for out in results:
        for by_layer in (False, True):
            got = out["sgd_missing", by_layer]
            assert all(grads[3] is None for grads in got["grads"])
            assert all(torch.equal(params[3], start) for params in got["params"])
            assert all(grads[1] is not None for grads in got["grads"])


@pytest.mark.parametrize("name", ["sgd", "sgd_weights", "custom_denom", "custom_bf16", "sgd_missing"])
def test_bytes_follow_the_ring_rule(runs, name):
    """Data: 2 (W-1)/W * elements * size of the dtype sent (fp32 for bf16); gradient counts and the
    denom check (8 bytes to each other rank) as control messages."""
    world, results = runs
    sent_size = torch.tensor([], dtype=torch.promote_types(_dtype(name), torch.float32)).element_size()
    numels = [torch.Size(s).numel() for s in cw.SHAPES]
    for by_layer in (False, True):
        for step, stats in enumerate(results[0][name, by_layer]["sent"], start=1):
            if not cw.SPECS[name][3].get("agg_grad", True):
                data, control = (numels if by_layer else [sum(numels)]), []
            else:
                present = [any(cw.rank_grads(name, step, r)[i] is not None for r in range(world))
                           for i in range(len(numels))]
                if by_layer:
                    data = [n for n, here in zip(numels, present) if here]
                    control = [ring_allreduce_bytes(len(numels), world, 4)]
                else:
                    data = [sum(numels)]
                    control = [ring_allreduce_bytes(len(numels), world, sent_size)]
                if cw.SPECS[name][3].get("average_custom"):
                    control.append((world - 1) * 8 * 2)
            assert stats["full_precision_calls"] == len(data)
            assert stats["control_calls"] == len(control)
            assert stats["bytes_sent"] == sum(ring_allreduce_bytes(n, world, sent_size) for n in data) + sum(control)
            assert stats["fp32_equivalent_bytes"] == sum(ring_allreduce_bytes(n, world, 4) for n in data)


def test_lr_scheduler_drives_the_local_lr(runs):
    world, results = runs
    lr0 = cw.SGD_KW["lr"]
    for by_layer in (False, True):
        lrs = results[0]["sgd_steplr", by_layer]["lrs"]
        assert lrs == [lr0 * 0.5 ** (t // 2) for t in range(cw.STEPS)]


# ------------------------------------------------------------------------------- resume
def test_resume_equals_an_uninterrupted_run_bitwise():
    results = run_ranks(2, cw.run_resume, cw.RESUME, timeout=180)
    for rank, out in enumerate(results):
        for (name, by_layer), got in out.items():
            s_model, s_opt, s_lr = got["straight"]
            r_model, r_opt, r_lr = got["resumed"]
            assert s_lr == r_lr == got["inner_lr"], (name, by_layer, rank)
            _assert_same_tree(torch.load(io.BytesIO(s_model)), torch.load(io.BytesIO(r_model)), (name, rank))
            _assert_same_tree(_groups_without_release(s_opt), _groups_without_release(r_opt), (name, rank))
    # weight averaging keeps per-rank optimizer state: each rank's own checkpoint is what resumes
    states = [torch.load(io.BytesIO(out["sgd_weights", False]["straight"][1]))["state"] for out in results]
    assert not torch.equal(states[0][0]["momentum_buffer"], states[1][0]["momentum_buffer"])


def _groups_without_release(data: bytes) -> dict:
    """lightning_optim's BaseOptimizer.load_state_dict adds a ``gradient_release`` key to every group
    (a flag kept out of the groups at construction); it changes no step, so it is left out here."""
    state = torch.load(io.BytesIO(data))
    for group in state["param_groups"]:
        group.pop("gradient_release", None)
    return state


def _assert_same_tree(a, b, where):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same_tree(a[k], b[k], where)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for x, y in zip(a, b):
            _assert_same_tree(x, y, where)
    else:
        assert a == b, where


# ------------------------------------------------------------------------------- training
@pytest.fixture(scope="module")
def trained():
    return run_ranks(2, cw.train_tiny_all, timeout=120)


@pytest.mark.parametrize("kind", cw.TRAIN_KINDS)
def test_trains_a_tiny_model_on_two_ranks(trained, kind):
    results = [out[kind] for out in trained]
    for out in results:
        assert out["losses"][-1] < 0.5 * out["losses"][0], out["losses"]
        assert out["calls"] == (["opt", "agg"] if kind == "weights" else ["agg", "opt"]) * 40
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)
