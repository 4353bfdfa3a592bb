"""SignSGD against RefSignSGD; SparsifiedSGD against RefSparsifiedSGD; their own features."""

from __future__ import annotations

import io

import pytest
import torch

from lightning_optim.optim.sign_sgd import SignSGD
from lightning_optim.optim.sparsified_sgd import SparsifiedSGD
from tests.optim.helpers import clone_params, grad_stream, make_params, max_abs_diff, run_steps, two_groups
from tests.reference.signsgd import RefSignSGD
from tests.reference.sparsified_sgd import RefSparsifiedSGD

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
STEPS = 12


def _refs(params, ref_cls, first: dict, second: dict, **shared):
    """One reference per group (the references take flat lists), on copies of ``params``."""
    ref_params = [p.detach().clone() for p in params]
    return [ref_cls(ref_params[:2], **first, **shared), ref_cls(ref_params[2:], **second, **shared)], ref_params


def _step_both(opt, params, refs, ref_params, step_grads, negate=False, before_ref=None):
    for p, g in zip(params, step_grads):
        p.grad = g.to(p.dtype)
    opt.step()
    grads = [(-g if negate else g).to(p.dtype) for p, g in zip(ref_params, step_grads)]
    if before_ref is not None:
        before_ref()
    refs[0].step(grads[:2])
    refs[1].step(grads[2:])


# ---------------------------------------------------------------- SignSGD
SIGN_CASES = [
    dict(),
    dict(weight_decay=0.1),
    dict(momentum=0.9),
    dict(momentum=0.9, dampening=0.3, weight_decay=0.1),
    dict(momentum=0.8, nesterov=True, weight_decay=0.05),
    dict(momentum=0.9, maximize=True),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("kwargs", SIGN_CASES, ids=str)
def test_sign_sgd_matches_reference(kwargs, foreach, dtype):
    kwargs = dict(kwargs)
    maximize = kwargs.pop("maximize", False)
    params = make_params(dtype)
    first = dict(lr=1e-2, **kwargs)
    second = dict(first, lr=3e-3, weight_decay=0.02)
    refs, ref_params = _refs(params, RefSignSGD, first, second)
    opt = SignSGD(two_groups(params, **second), foreach=foreach, maximize=maximize, **first)
    for i, step_grads in enumerate(grad_stream(steps=STEPS)):
        if i == 6:
            for group, ref in zip(opt.param_groups, refs):
                group["lr"] *= 0.5
                ref.lr *= 0.5
        _step_both(opt, params, refs, ref_params, step_grads, negate=maximize)
    assert max_abs_diff(params, ref_params) < TOL[dtype]
    assert max_abs_diff(params, make_params(dtype)) > 1e-2


@pytest.mark.parametrize("foreach", [False, True])
def test_sign_sgd_fully_decoupled_decay(foreach):
    # decouple_lr: p <- p (1 - (lr/max_lr) wd) - lr sign(d), d without the L2 term
    lr, max_lr, wd = 1e-2, 2e-2, 0.1
    params = make_params(torch.float64)
    refs, ref_params = _refs(params, RefSignSGD, dict(lr=lr, momentum=0.9), dict(lr=lr, momentum=0.9))
    opt = SignSGD(params, lr=lr, momentum=0.9, weight_decay=wd, decouple_lr=True, max_lr=max_lr, foreach=foreach)

    def decay():
        for p in ref_params:
            p.mul_(1 - lr / max_lr * wd)

    for step_grads in grad_stream(steps=STEPS):
        _step_both(opt, params, refs, ref_params, step_grads, before_ref=decay)
    assert max_abs_diff(params, ref_params) < 1e-12


@pytest.mark.parametrize("kwargs,arg", [
    (dict(lr=-1.0), "lr"), (dict(momentum=-0.1), "momentum"), (dict(dampening=1.5), "dampening"),
    (dict(weight_decay=-0.1), "weight_decay"), (dict(nesterov="yes"), "nesterov"),
    (dict(nesterov=True), "nesterov"), (dict(momentum=0.9, dampening=0.1, nesterov=True), "nesterov"),
    (dict(decouple_lr=True, max_lr=-1.0), "max_lr"), (dict(kahan_sum="auto"), "kahan_sum"),
])
def test_bad_sign_sgd_arguments(kwargs, arg):
    with pytest.raises((ValueError, TypeError), match=arg):
        SignSGD(make_params(), **{"lr": 1e-2, **kwargs})


def test_sign_sgd_accumulation_needs_momentum():
    with pytest.raises(ValueError, match="momentum"):
        SignSGD(make_params(), lr=1e-2).optimizer_accumulation = True


# ---------------------------------------------------------------- SparsifiedSGD
SPARSE_CASES = [
    dict(mode="random"),
    dict(random_sparse=True, weight_decay=0.01),  # mlbench's flag picks "random"
    dict(weight_decay=0.01),  # mlbench's default: blockwise
    dict(mode="blockwise", weight_decay=0.01, wd_in_memory=True),
    dict(mode="topk", weight_decay=0.01),
]


def _sparse_pair(params, kwargs, seed=5, **ours):
    first = dict(lr=0.1, sparse_grad_size=4, **kwargs)
    second = dict(first, lr=0.05, sparse_grad_size=3)
    # the references draw from one shared generator, group by group: the same order as ours
    ref_gen = torch.Generator().manual_seed(seed)
    refs, ref_params = _refs(params, RefSparsifiedSGD, first, second, generator=ref_gen)
    opt = SparsifiedSGD(two_groups(params, **second), generator=torch.Generator().manual_seed(seed), **first, **ours)
    return opt, refs, ref_params


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("kwargs", SPARSE_CASES, ids=str)
def test_sparsified_sgd_matches_reference(kwargs, foreach, dtype):
    params = make_params(dtype)
    opt, refs, ref_params = _sparse_pair(params, kwargs, foreach=foreach)
    for i, step_grads in enumerate(grad_stream(steps=STEPS)):
        if i == 6:
            for group, ref in zip(opt.param_groups, refs):
                group["lr"] *= 0.5
                ref.lr *= 0.5
        _step_both(opt, params, refs, ref_params, step_grads)
        opt.update_estimated_weights(i)
        refs[0].update_estimated_weights(i)
        refs[1].update_estimated_weights(i)
        # memory holds what was not applied yet
        ref_memory = refs[0].memory + refs[1].memory
        assert max_abs_diff([opt.state[p]["memory"] for p in params], ref_memory) < TOL[dtype]
    assert max_abs_diff(params, ref_params) < TOL[dtype]
    estimated = refs[0].get_estimated_weights() + refs[1].get_estimated_weights()
    assert max_abs_diff(opt.get_estimated_weights(), estimated) < TOL[dtype]
    assert max_abs_diff(params, make_params(dtype)) > 1e-2
    assert max_abs_diff(opt.get_estimated_weights(), params) > 1e-3  # a real average, not the params


def test_sparsified_sgd_applies_exactly_k_coordinates_per_tensor():
    params = make_params(torch.float64)
    opt = SparsifiedSGD(params, lr=0.1, sparse_grad_size=4, mode="random", generator=torch.Generator().manual_seed(0))
    before = [p.detach().clone() for p in params]
    run_steps(opt, params, grad_stream(steps=1))
    for p, b in zip(params, before):
        assert int((p != b).sum()) == min(4, p.numel())
        assert int((opt.state[p]["memory"] != 0).sum()) == p.numel() - min(4, p.numel())


def test_sparsified_sgd_index_fn_drives_both_and_counts_params_over_groups():
    seen = []

    def index_fn(i, flat, k):  # deterministic: the k smallest |memory|
        seen.append(i)
        return torch.topk(flat.abs(), k, largest=False).indices

    params = make_params(torch.float64)
    opt, refs, ref_params = _sparse_pair(params, dict(weight_decay=0.01), index_fn=index_fn)
    for r, offset in zip(refs, (0, 2)):  # the references number params per instance
        r.index_fn = lambda i, flat, k, o=offset: index_fn(i + o, flat, k)
    for step_grads in grad_stream(steps=4):
        _step_both(opt, params, refs, ref_params, step_grads)
    assert max_abs_diff(params, ref_params) < 1e-12
    assert seen[:4] == [0, 1, 2, 3]


def test_sparsified_sgd_accumulation_sums_into_the_memory():
    # two accumulated micro-steps then an applied one == one step with the summed gradient
    grads = grad_stream(steps=3)
    params = make_params(torch.float64)
    opt = SparsifiedSGD(params, lr=0.1, weight_decay=0.01, sparse_grad_size=4, mode="topk")
    run_steps(opt, params, grads, before_step=lambda i: setattr(opt, "optimizer_accumulation", i < 2))
    summed = [[sum(g[j] for g in grads) for j in range(len(grads[0]))]]
    once = make_params(torch.float64)
    run_steps(SparsifiedSGD(once, lr=0.1, weight_decay=0.01, sparse_grad_size=4, mode="topk"), once, summed)
    assert max_abs_diff(params, once) < 1e-12
    assert max_abs_diff(params, make_params(torch.float64)) > 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["random", "blockwise", "topk"])
def test_sparsified_sgd_foreach_equals_for_loop(mode, dtype):
    base = make_params(dtype)
    runs = []
    for foreach in (False, True):
        params = clone_params(base)
        opt = SparsifiedSGD(two_groups(params, lr=0.05), lr=0.1, weight_decay=0.01, sparse_grad_size=3, mode=mode,
                            generator=torch.Generator().manual_seed(1), foreach=foreach)
        run_steps(opt, params, grad_stream(steps=8))
        runs.append(params)
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("mode", ["random", "blockwise"])
def test_sparsified_sgd_round_trip_restores_the_generator(mode):
    base = make_params()
    grads = grad_stream(steps=10)
    kwargs = dict(lr=0.1, weight_decay=0.01, sparse_grad_size=3, mode=mode)
    p_full = clone_params(base)
    run_steps(SparsifiedSGD(two_groups(p_full, lr=0.05), generator=torch.Generator().manual_seed(7), **kwargs),
              p_full, grads)
    p_first = clone_params(base)
    first = SparsifiedSGD(two_groups(p_first, lr=0.05), generator=torch.Generator().manual_seed(7), **kwargs)
    run_steps(first, p_first, grads[:5])
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    p_resumed = clone_params(p_first)
    # a differently seeded generator: the loaded state must replace its state
    resumed = SparsifiedSGD(two_groups(p_resumed, lr=0.05), generator=torch.Generator().manual_seed(99), **kwargs)
    resumed.load_state_dict(torch.load(buf))
    run_steps(resumed, p_resumed, grads[5:])
    assert all(torch.equal(a, b) for a, b in zip(p_full, p_resumed))


def test_sparsified_sgd_kahan_tracks_fp32_better_in_bf16():
    shapes = [(64, 32), (256,)]
    base = make_params(torch.float32, shapes=shapes)
    grads = grad_stream(shapes=shapes, steps=40)
    runs = {}
    for label, dtype, kahan in (("fp32", torch.float32, None), ("kahan", torch.bfloat16, True),
                                ("plain", torch.bfloat16, False)):
        params = clone_params(base, dtype)
        opt = SparsifiedSGD(params, lr=1e-3, sparse_grad_size=256, mode="topk", kahan_sum=kahan, fp32_state=True)
        run_steps(opt, params, grads)
        runs[label] = params

    def err(label):
        return max((p.double() - q.double()).abs().mean().item() for p, q in zip(runs[label], runs["fp32"]))

    assert err("kahan") < 0.5 * err("plain")


@pytest.mark.parametrize("kwargs,arg", [
    (dict(lr=-0.1), "lr"), (dict(weight_decay=-0.1), "weight_decay"), (dict(sparse_grad_size=0), "sparse_grad_size"),
    (dict(sparse_grad_size=2.5), "sparse_grad_size"), (dict(sparse_grad_size=True), "sparse_grad_size"),
    (dict(random_sparse="yes"), "random_sparse"), (dict(mode="top"), "mode"), (dict(wd_in_memory=1), "wd_in_memory"),
    (dict(generator=0), "generator"), (dict(index_fn="topk"), "index_fn"), (dict(fp32_state="no"), "fp32_state"),
])
def test_bad_sparsified_sgd_arguments(kwargs, arg):
    with pytest.raises((ValueError, TypeError), match=arg):
        SparsifiedSGD(make_params(), **{"lr": 0.1, **kwargs})


def test_bad_estimated_weight_arguments():
    opt = SparsifiedSGD(make_params(), lr=0.1)
    with pytest.raises(ValueError, match="iteration"):
        opt.update_estimated_weights(-1)
    with pytest.raises(ValueError, match="sparse_vector_size"):
        opt.update_estimated_weights(1, sparse_vector_size=0)
