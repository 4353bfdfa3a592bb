"""Probes at the edges of the 1-bit optimizers: every constructor argument, refused steps, group
changes around the variance freeze, resuming from full-precision Adam/AdamW/LAMB state dicts, and
the automatic mask of never-moving elements (on real gloo ranks, against the reference simulation).
"""
from __future__ import annotations

import copy
import inspect
import io
import math

import numpy as np
import pytest
import torch

import lightning_optim as lo
from lightning_optim import OnebitAdam, OnebitLamb, ZeroOneAdam
from tests.ranks import run_ranks
from tests.reference.onebit_adam import RefOnebitAdam
from tests.reference.zero_one_adam import RefZeroOneAdam

CLASSES = (OnebitAdam, ZeroOneAdam, OnebitLamb)
FREEZE_ARG = {OnebitAdam: "freeze_step", ZeroOneAdam: "var_freeze_step", OnebitLamb: "freeze_step"}

# argument -> [(bad value, error type, words the message must hold)]
BAD = {
    "lr": [(-1.0, ValueError, "lr"), (float("nan"), ValueError, "lr"), ("x", TypeError, "lr")],
    "freeze_step": [(0, ValueError, "freeze_step must be an integer >= 1"), (-1, ValueError, "freeze_step"),
                    (2.5, TypeError, "freeze_step"), ("Auto", ValueError, "freeze_step must be an integer >= 1 or 'auto'")],
    # with the default (fixed) freeze_step; their ranges under freeze_step="auto": test_auto_freeze_ranges
    "auto_freeze_window": [(5, ValueError, "auto_freeze_window: only with freeze_step='auto'")],
    "auto_freeze_tolerance": [(0.1, ValueError, "auto_freeze_tolerance: only with freeze_step='auto'")],
    "auto_freeze_max": [(50, ValueError, "auto_freeze_max: only with freeze_step='auto'")],
    "var_freeze_step": [(0, ValueError, "var_freeze_step must be an integer >= 1"), (1.0, TypeError, "var_freeze_step")],
    "var_update_scaler": [(0, ValueError, "var_update_scaler must be an integer >= 1")],
    "local_step_scaler": [(0, ValueError, "local_step_scaler must be an integer >= 1")],
    "local_step_clipper": [(0, ValueError, "local_step_clipper must be an integer >= 1")],
    "betas": [((1.0, 0.999), ValueError, r"betas[0] must be in [0, 1)"), ("ab", TypeError, "betas")],
    "eps": [(0.0, ValueError, "eps must be in (0, inf)")],
    "weight_decay": [(-0.1, ValueError, "weight_decay must be in [0, inf)")],
    "max_grad_norm": [(-1.0, ValueError, "max_grad_norm must be in [0, inf)")],
    "bias_correction": [("yes", TypeError, "bias_correction must be True or False")],
    "eps_inside_sqrt": [(1, TypeError, "eps_inside_sqrt must be True or False")],
    "amsgrad": [(True, ValueError, "amsgrad"), ("no", TypeError, "amsgrad")],
    "cuda_aware": [("no", TypeError, "cuda_aware")],
    "comm_backend_name": [("smoke", ValueError, "comm_backend_name must be one of")],
    "process_group": [("x", TypeError, "process_group must be None"), (3, TypeError, "process_group")],
    "average_grads": [("yes", TypeError, "average_grads must be True or False")],
    "kahan_sum": [("yes", TypeError, "kahan_sum")],
    "gradient_release": [("yes", TypeError, "gradient_release"), (True, ValueError, "gradient_release: not possible")],
    "hierarchical": [(0, ValueError, "hierarchical must be True, False or the number of ranks per node"),
                     (-2, ValueError, "hierarchical"), (1.5, TypeError, "hierarchical"), ("2", TypeError, "hierarchical"),
                     (None, TypeError, "hierarchical")],
    "auto_mask": [(1.0, ValueError, "auto_mask must be in [0, 1)"), (-0.1, ValueError, "auto_mask"),
                  ("x", TypeError, "auto_mask"), (None, TypeError, "auto_mask must be True, False or a ratio")],
    "max_coeff": [(0.0, ValueError, "max_coeff")],
    "min_coeff": [(-1.0, ValueError, "min_coeff")],
    "coeff_beta": [(1.0, ValueError, "coeff_beta must be in [0, 1)")],
    "factor_max": [(-1.0, ValueError, "factor_max")],
    "factor_min": [(-1.0, ValueError, "factor_min")],
    "factor_threshold": [(-1.0, ValueError, "factor_threshold")],
}


def _args(cls):
    return [n for n in inspect.signature(cls).parameters if n != "params"]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_constructor_argument_refuses_bad_values_by_name(cls):
    assert set(_args(cls)) <= set(BAD), f"arguments without a probe: {set(_args(cls)) - set(BAD)}"
    for name in _args(cls):
        for value, error, words in BAD[name]:
            with pytest.raises(error) as info:
                cls([torch.zeros(3, requires_grad=True)], **{name: value})
            assert words in str(info.value), (name, value, str(info.value))


AUTO_BAD = {
    "auto_freeze_window": [(0, ValueError, "auto_freeze_window must be an integer >= 1"),
                           (2.0, TypeError, "auto_freeze_window")],
    "auto_freeze_tolerance": [(0.0, ValueError, "auto_freeze_tolerance must be a number in (0, 1)"),
                              (1.0, ValueError, "auto_freeze_tolerance"), ("x", ValueError, "auto_freeze_tolerance"),
                              (True, ValueError, "auto_freeze_tolerance")],
    "auto_freeze_max": [(0, ValueError, "auto_freeze_max must be an integer >= 1"), (None, None, None)],
}


@pytest.mark.parametrize("cls", [OnebitAdam, OnebitLamb], ids=lambda c: c.__name__)
def test_auto_freeze_ranges(cls):
    for name, probes in AUTO_BAD.items():
        for value, error, words in probes:
            if error is None:  # None: the default
                assert cls([torch.zeros(3, requires_grad=True)], freeze_step="auto", **{name: value}).auto_freeze
                continue
            with pytest.raises(error) as info:
                cls([torch.zeros(3, requires_grad=True)], freeze_step="auto", **{name: value})
            assert words in str(info.value), (name, value, str(info.value))


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_numpy_scalars_are_accepted_like_python_numbers(cls):
    for name, default in inspect.signature(cls).parameters.items():
        if isinstance(default.default, bool) or not isinstance(default.default, (int, float)):
            continue
        value = default.default if name != FREEZE_ARG[cls] else 5
        numpy_value = np.int64(value) if isinstance(value, int) else np.float32(value)
        opt = cls([torch.zeros(3, requires_grad=True)], **{name: numpy_value})
        seen = opt.param_groups[0].get(name, getattr(opt, name, None))
        assert seen == pytest.approx(float(numpy_value)), name


def _snapshot(opt, params):
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    return buf.getvalue(), [p.detach().clone() for p in params], copy.deepcopy(opt._sched)


def _same(a, b):
    return a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1], b[1])) and a[2] == b[2]


def _feed(opt, params, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            if p.requires_grad:
                p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_a_refused_step_changes_nothing(cls):
    params = [torch.randn(4, 3, requires_grad=True), torch.randn(5, requires_grad=True)]
    fresh = cls(params, **{FREEZE_ARG[cls]: 2})
    params[0].grad = torch.randn(4, 3).to_sparse()
    params[1].grad = torch.randn(5)
    with pytest.raises(ValueError, match="sparse gradients"):
        fresh.step()
    assert len(fresh.state) == 0 and fresh.global_step == 0  # nothing was created
    for stage_steps in (1, 3):  # warmup, then compression
        opt = cls(params, **{FREEZE_ARG[cls]: 2})
        _feed(opt, params, stage_steps)
        before = _snapshot(opt, params)
        params[0].grad = torch.randn(4, 3).to_sparse()
        with pytest.raises(ValueError, match="sparse gradients"):
            opt.step()
        assert _same(before, _snapshot(opt, params))


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_group_changes_before_the_freeze_work_and_after_it_are_refused(cls):
    params = [torch.randn(4, 3, requires_grad=True), torch.randn(5, requires_grad=True), torch.randn(2, requires_grad=True)]
    opt = cls(params[:1], **{FREEZE_ARG[cls]: 3})
    _feed(opt, params[:1], 1)
    opt.add_param_group({"params": [params[1]]})  # in warmup: joins, gets its own variance
    _feed(opt, params[:2], 4, seed=1)
    assert all(torch.isfinite(p).all() for p in params[:2])
    before = _snapshot(opt, params[:2])
    with pytest.raises(ValueError, match=r"add_param_group: .* froze its variance at step 3"):
        opt.add_param_group({"params": [params[2]]})
    assert len(opt.param_groups) == 2 and _same(before, _snapshot(opt, params[:2]))
    # a param that starts training after the freeze has no variance: refused at the step
    late = cls([params[0], params[2]], **{FREEZE_ARG[cls]: 2})
    params[2].requires_grad_(False)
    _feed(late, [params[0]], 3)
    params[2].requires_grad_(True)
    before = _snapshot(late, [params[0], params[2]])
    with pytest.raises(ValueError, match="1 of 2 trained params have no variance estimate"):
        _feed(late, [params[0], params[2]], 1)
    assert _same(before, _snapshot(late, [params[0], params[2]]))


def test_plain_lamb_state_loads_before_the_freeze_only():
    params = [torch.randn(4, 3, requires_grad=True)]
    lamb = lo.Lamb(params, lr=1e-2)
    _feed(lamb, params, 3)
    saved = lamb.state_dict()
    with pytest.raises(ValueError, match=r"saved at step 3 cannot resume as OnebitLamb with freeze_step=3"):
        OnebitLamb(params, freeze_step=3).load_state_dict(saved)
    opt = OnebitLamb(params, freeze_step=5)
    opt.load_state_dict(saved)
    assert opt.global_step == 3
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(opt.state[params[0]][key], lamb.state[params[0]][key])
    _feed(opt, params, 3)
    assert opt.in_compression_stage and torch.isfinite(params[0]).all()


# ------------------------------------------------------------ on real ranks
SHAPES = [(4, 3), (6,)]
TINY = slice(3, 6)  # param 1: elements 3, 4 get ~1e-7 gradients, element 5 exactly 0


def _params():
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def _grads(step, rank):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    grads = [torch.randn(s, generator=gen) for s in SHAPES]
    grads[1][3:5] *= 1e-7
    grads[1][5] = 0.0
    return grads


def _mean_grads(step, world):
    per_rank = [_grads(step, r) for r in range(world)]
    return [sum(g[j] for g in per_rank) / world for j in range(len(SHAPES))]


def _train(rank, world, opt, params, steps, first=1):
    for t in range(first, first + steps):
        for p, g in zip(params, _grads(t, rank)):
            p.grad = g.clone()
        opt.step()
    return [p.detach().clone() for p in params]


SOURCES = {
    "torch.Adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "torch.AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "lo.Adam": lambda ps: lo.Adam(ps, lr=1e-2),
    "lo.AdamW": lambda ps: lo.AdamW(ps, lr=1e-2, weight_decay=0.1),
}


def _resume_worker(rank, world):
    out = {}
    for source, make in SOURCES.items():
        wd = 0.1 if "AdamW" in source else 0.0
        targets = {
            "OnebitAdam@4": lambda ps: OnebitAdam(ps, lr=1e-2, weight_decay=wd, freeze_step=4, auto_mask=False),
            "OnebitAdam@2": lambda ps: OnebitAdam(ps, lr=1e-2, weight_decay=wd, freeze_step=2, auto_mask=False),
            "ZeroOneAdam@var": lambda ps: ZeroOneAdam(ps, lr=1e-2, weight_decay=wd, var_update_scaler=4,
                                                      auto_mask=False),
            "ZeroOneAdam@local": lambda ps: ZeroOneAdam(ps, lr=1e-2, weight_decay=wd, var_freeze_step=4,
                                                        var_update_scaler=4, local_step_scaler=2, auto_mask=False),
        }
        for target, build in targets.items():
            params = [p.clone().requires_grad_(True) for p in _params()]
            plain = make(params)
            for t in range(1, 5):  # the running job: 4 full-precision steps on the rank-mean gradient
                for p, g in zip(params, _mean_grads(t, world)):
                    p.grad = g
                plain.step()
            opt = build(params)
            opt.load_state_dict(plain.state_dict())
            out[(source, target)] = _train(rank, world, opt, params, 4, first=5)
    return out


def test_resuming_full_precision_adam_follows_the_reference():
    world = 2
    out = run_ranks(world, _resume_worker, timeout=180)
    for (source, target), got in out[0].items():
        assert all(torch.equal(a, b) for a, b in zip(got, out[1][(source, target)])), (source, target)
        wd = 0.1 if "AdamW" in source else 0.0
        if target.startswith("OnebitAdam"):
            ref = RefOnebitAdam(_params(), world, lr=1e-2, freeze_step=4, weight_decay=wd)
        elif target == "ZeroOneAdam@var":
            ref = RefZeroOneAdam(_params(), world, lr=1e-2, weight_decay=wd, var_update_scaler=4)
        else:
            ref = RefZeroOneAdam(_params(), world, lr=1e-2, weight_decay=wd, var_freeze_step=4,
                                 var_update_scaler=4, local_step_scaler=2)
        for t in range(1, 9):
            ref.step([_grads(t, r) for r in range(world)])
        for a, b in zip(got, ref.params[0]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"{source} -> {target}")


def _mask_worker(rank, world, auto_mask, cls_name):
    params = [p.clone().requires_grad_(True) for p in _params()]
    user_mask = torch.tensor([[1.0, 0.0, 1.0]] * 4)
    groups = [{"params": [params[0]], "exp_avg_mask": user_mask}, {"params": [params[1]]}]
    if cls_name == "OnebitAdam":
        opt = OnebitAdam(groups, lr=1e-2, freeze_step=3, auto_mask=auto_mask)
    else:
        opt = ZeroOneAdam(groups, lr=1e-2, var_freeze_step=6, var_update_scaler=1, auto_mask=auto_mask)
    return [_train(rank, world, opt, params, 1, first=t) for t in range(1, 9)]  # params after each step


def _reference_mask(ref_cls, kwargs, world, rho):
    """The rule, applied by the test to the reference's own variance after its first step."""
    ref = ref_cls(_params(), world, **kwargs)
    ref.step([_grads(1, r) for r in range(world)])
    masks = []
    for v in ref.v[0]:
        masks.append((v.double() > rho**2 * v.double().mean()).float())
    return masks


@pytest.mark.parametrize("cls_name", ["OnebitAdam", "ZeroOneAdam"])
def test_auto_mask_keeps_never_moving_elements_still(cls_name):
    world, rho = 2, 1e-3
    ref_cls, kwargs = ((RefOnebitAdam, dict(lr=1e-2, freeze_step=3)) if cls_name == "OnebitAdam"
                       else (RefZeroOneAdam, dict(lr=1e-2, var_freeze_step=6, var_update_scaler=1)))
    auto = _reference_mask(ref_cls, kwargs, world, rho)
    assert auto[1].tolist() == [1, 1, 1, 0, 0, 0] and bool(auto[0].all())  # the rule picks the tiny ones
    user = torch.tensor([[1.0, 0.0, 1.0]] * 4)
    masked = run_ranks(world, _mask_worker, rho, cls_name, timeout=120)
    unmasked = run_ranks(world, _mask_worker, False, cls_name, timeout=120)
    ref = ref_cls(_params(), world, masks=[user * auto[0], auto[1]], **kwargs)
    plain_ref = ref_cls(_params(), world, masks=[user, None], **kwargs)
    for t in range(1, 9):
        ref.step([_grads(t, r) for r in range(world)])
        plain_ref.step([_grads(t, r) for r in range(world)])
    for a, b in zip(masked[0][-1], ref.params[0]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    for a, b in zip(unmasked[0][-1], plain_ref.params[0]):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
    # OnebitAdam: from the freeze on; ZeroOneAdam: its variance-stage steps still follow the element's own
    # (real, decaying) momentum, the first local-stage synchronisation replaces it by the masked average
    last_full = 3 if cls_name == "OnebitAdam" else 6
    frozen = masked[0][last_full - 1][1][TINY]
    assert torch.equal(masked[0][-1][1][TINY], frozen)  # masked elements never moved after it
    drift = (unmasked[0][-1][1][TINY] - unmasked[0][last_full - 1][1][TINY]).abs().max().item()
    assert drift > 1.0, drift  # without the mask: compression noise over a ~1e-7 sqrt(v), lr 0.01


def test_unmanaged_ddp_allreduce_warns_once():
    from tests.onebit.unmanaged_workers import unmanaged
    from tests.ranks import run_ranks

    for messages, unmanaged_steps, ratio in run_ranks(2, unmanaged, False, timeout=60):
        assert len(messages) == 1 and "DDP's fp32 allreduce still runs" in messages[0]
        assert unmanaged_steps == 3 and math.isnan(ratio)  # steps 3-5 compressed; DDP's bytes unseen
    for messages, unmanaged_steps, ratio in run_ranks(2, unmanaged, True, timeout=60):
        assert messages == [] and unmanaged_steps == 0 and not math.isnan(ratio)


@pytest.mark.parametrize("cls,kwargs", [(OnebitAdam, dict(freeze_step=3)), (ZeroOneAdam, dict(var_freeze_step=3)),
                                        (OnebitLamb, dict(freeze_step=3))], ids=lambda x: getattr(x, "__name__", ""))
def test_the_sparse_auto_mask_equals_the_full_multiply(cls, kwargs, monkeypatch):
    """The auto mask multiplies only its masked elements when they are few: the same params and states,
    bit for bit, as multiplying the whole buffer by the 0/1 mask."""
    from lightning_optim.onebit import masks

    def run(ratio):
        monkeypatch.setattr(masks, "SPARSE_MASK_RATIO", ratio)
        params = [p.requires_grad_() for p in _params()]
        opt = cls(params, lr=1e-2, **kwargs)
        for t in range(1, 9):
            for p, g in zip(params, _grads(t, 0)):
                p.grad = g
            opt.step()
        masked = opt._layout.scratch["zero_mask"][2]
        return params, [v for p in params for v in opt.state[p].values() if isinstance(v, torch.Tensor)], masked

    dense, sparse = run(10**9), run(0)  # masked * ratio < numel: the sparse path
    assert sparse[2].numel() == 3  # the rule picked param 1's tiny elements
    for a, b in zip(sparse[0] + sparse[1], dense[0] + dense[1]):
        assert torch.equal(a, b)


def test_the_compression_stage_frees_the_warmups_gradient_copy():
    """OnebitAdam's compression stage reads p.grad; the flat fp32 copy the warmup averaged in is released."""
    model = torch.nn.Linear(64, 64)
    opt = OnebitAdam(model.parameters(), freeze_step=2)
    for step in range(1, 5):
        model(torch.randn(8, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        assert ("grad" in opt._layout.scratch) == (step <= 2), step  # step 3 is the first 1-bit step
