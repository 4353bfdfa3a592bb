"""Lamb, FusedLamb and Lars against the independent references in tests/reference (and torch.optim)."""

from __future__ import annotations

import inspect
import io
import math

import pytest
import torch

from lightning_optim.optim.lamb import FusedLamb, Lamb
from lightning_optim.optim.lars import Lars
from lightning_optim.optim.release import prepare_for_gradient_release
from tests.optim.helpers import clone_params, grad_stream, make_params, max_abs_diff, run_steps, two_groups
from tests.reference.lamb import RefLAMB
from tests.reference.lars import RefLARS

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
STEPS = 12


def _run_against_refs(opt, params, refs, grads, change_lr_at=None):
    """Step ``opt`` (on ``params``) and each ``(ref, slice)`` on the same float64 grads.

    Returns the trust ratios per step: ours (from ``state["lamb_coeff"]``) and the references'.
    """
    ours_ratios, ref_ratios = [], []
    for i, step_grads in enumerate(grads):
        if i == change_lr_at:  # an LR scheduler changing the lr mid-training
            for group in opt.param_groups:
                group["lr"] *= 0.5
            for ref, _ in refs:
                ref.lr *= 0.5
        for p, g in zip(params, step_grads):
            p.grad = g.to(p.dtype)
        opt.step()
        for ref, sl in refs:
            ref.step(step_grads[sl])
        if isinstance(opt, Lamb):
            ours_ratios.append(opt.get_lamb_coeffs())
            ref_ratios.append([r for ref, _ in refs for r in ref.last_trust_ratios])
    return ours_ratios, ref_ratios


# ---------------------------------------------------------------- Lamb vs RefLAMB
LAMB_CASES = [
    dict(),
    dict(bias_correction=False),
    dict(eps_inside_sqrt=True),
    dict(adam_w_mode=False),
    dict(grad_averaging=False),
    dict(use_nvlamb=True),
    dict(adam=True),
    dict(min_coeff=0.9, max_coeff=1.5),  # clamps hit in the decayed group
    dict(use_nvlamb=True, min_coeff=0.05, max_coeff=2.0),  # clamps hit in both groups
    dict(use_nvlamb=True, min_coeff=0.0, max_coeff=math.inf),  # apex FusedLAMB: no clamp
    dict(bias_correction=False, use_nvlamb=True, min_coeff=0.0, max_coeff=math.inf),  # ColossalAI Lamb
]
GROUP_A = dict(lr=0.05, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.1)
GROUP_B = dict(lr=0.02, betas=(0.8, 0.99), eps=1e-5, weight_decay=0.0)  # the wd == 0 group


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("foreach", [False, True], ids=["loop", "foreach"])
@pytest.mark.parametrize("flags", LAMB_CASES, ids=str)
def test_lamb_matches_reference_two_groups(flags, foreach, dtype):
    base = make_params(torch.float64)
    params, ref_params = clone_params(base, dtype), clone_params(base)
    opt = Lamb(two_groups(params, **GROUP_B), foreach=foreach, **GROUP_A, **flags)
    refs = [(RefLAMB(ref_params[:2], **GROUP_A, **flags), slice(0, 2)),
            (RefLAMB(ref_params[2:], **GROUP_B, **flags), slice(2, None))]
    ours_r, ref_r = _run_against_refs(opt, params, refs, grad_stream(steps=STEPS), change_lr_at=6)
    assert max_abs_diff(params, ref_params) < TOL[dtype]
    assert max_abs_diff(params, base) > 1e-2  # it really trained
    assert max(abs(a - b) for o, r in zip(ours_r, ref_r) for a, b in zip(o, r)) < TOL[dtype]
    ratios = [r for step in ref_r for r in step]
    if "max_coeff" in flags and math.isfinite(flags["max_coeff"]):
        assert flags["max_coeff"] in ratios and flags["min_coeff"] in ratios  # both clamps were hit
    if flags.get("adam"):
        assert set(ratios) == {1.0}
    elif not flags.get("use_nvlamb"):
        assert all(step[2:] == [1.0, 1.0] for step in ours_r)  # wd == 0 group: no trust ratio
        assert any(r != 1.0 for step in ours_r for r in step[:2])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("foreach", [False, True], ids=["loop", "foreach"])
@pytest.mark.parametrize("flags", [dict(), dict(adam_w_mode=False), dict(use_nvlamb=True, max_coeff=1.5)], ids=str)
def test_lamb_global_grad_norm_clipping_matches_reference(flags, foreach, dtype):
    max_grad_norm = 3.0
    grads = grad_stream(steps=STEPS)
    global_norms = [math.sqrt(sum(float(g.square().sum()) for g in step)) for step in grads]
    assert min(global_norms) > 2 * max_grad_norm  # the clip really acts at every step
    base = make_params(torch.float64)
    params, ref_params = clone_params(base, dtype), clone_params(base)
    kwargs = dict(lr=0.05, betas=(0.85, 0.99), max_grad_norm=max_grad_norm, **flags)
    opt = Lamb(two_groups(params, weight_decay=0.0), weight_decay=0.2, foreach=foreach, **kwargs)
    ref = RefLAMB(ref_params, weight_decay=[0.2, 0.2, 0.0, 0.0], **kwargs)  # one global norm for both groups
    _run_against_refs(opt, params, [(ref, slice(None))], grads)
    assert max_abs_diff(params, ref_params) < TOL[dtype]

    unclipped = clone_params(base, dtype)
    run_steps(Lamb(two_groups(unclipped, weight_decay=0.0), weight_decay=0.2, foreach=foreach,
                   **{**kwargs, "max_grad_norm": 0.0}), unclipped, grads)
    assert max_abs_diff(params, unclipped) > 1e-3  # clipping changed the result


def test_lamb_clip_threshold_above_the_norm_changes_nothing():
    base = make_params()
    a, b = clone_params(base), clone_params(base)
    grads = grad_stream(steps=5)
    run_steps(Lamb(a, lr=0.05, weight_decay=0.1, max_grad_norm=1e3), a, grads)
    run_steps(Lamb(b, lr=0.05, weight_decay=0.1), b, grads)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_lamb_zero_param_gets_trust_ratio_one():
    params = [torch.zeros(6, dtype=torch.float64, requires_grad=True), *make_params(torch.float64)[:2]]
    ref_params = clone_params(params)
    shapes = [tuple(p.shape) for p in params]
    opt = Lamb(params, lr=0.05, weight_decay=0.1, use_nvlamb=True)
    ref = RefLAMB(ref_params, lr=0.05, weight_decay=0.1, use_nvlamb=True)
    ours_r, ref_r = _run_against_refs(opt, params, [(ref, slice(None))], grad_stream(shapes, steps=4))
    assert ours_r[0][0] == 1.0 and ref_r[0][0] == 1.0  # ||p|| == 0 at the first step
    assert ours_r[1][0] != 1.0
    assert max_abs_diff(params, ref_params) < 1e-10


@pytest.mark.parametrize("kwargs,torch_cls,torch_kwargs", [
    (dict(weight_decay=0.0), torch.optim.Adam, dict()),
    (dict(weight_decay=0.1), torch.optim.AdamW, dict(weight_decay=0.1)),
    (dict(weight_decay=0.1, adam_w_mode=False), torch.optim.Adam, dict(weight_decay=0.1)),
], ids=["adam", "adamw", "adam_l2"])
def test_lamb_with_adam_flag_is_torch_adam(kwargs, torch_cls, torch_kwargs):
    base = make_params(torch.float64)
    ours, theirs = clone_params(base), clone_params(base)
    grads = grad_stream(steps=STEPS)
    common = dict(lr=0.03, betas=(0.85, 0.98), eps=1e-7)
    run_steps(Lamb(ours, adam=True, **common, **kwargs), ours, grads)
    run_steps(torch_cls(theirs, **common, **torch_kwargs), theirs, grads)
    assert max_abs_diff(ours, theirs) < 1e-12


@pytest.mark.parametrize("cls,kwargs", [
    (Lamb, dict(lr=0.05, weight_decay=0.1, use_nvlamb=True, max_grad_norm=3.0, eps_inside_sqrt=True)),
    (Lamb, dict(lr=0.05, weight_decay=0.1, adam_w_mode=False, grad_averaging=False, min_coeff=0.9, max_coeff=1.2)),
    (FusedLamb, dict(lr=0.05, weight_decay=0.1, max_grad_norm=3.0)),
    (Lars, dict(lr=0.5, momentum=0.9, weight_decay=0.01, eeta=0.02, grad_clip=1.5, trust_clip=0.05)),
    (Lars, dict(lr=0.5, eeta=0.02)),
], ids=["lamb_nvlamb_clip", "lamb_l2_clamp", "fusedlamb", "lars_momentum", "lars_plain"])
def test_foreach_equals_for_loop_bitwise(cls, kwargs):
    base = make_params()
    loop, multi = clone_params(base), clone_params(base)
    grads = grad_stream(steps=STEPS)
    run_steps(cls(two_groups(loop, lr=0.01), foreach=False, **kwargs), loop, grads)
    run_steps(cls(two_groups(multi, lr=0.01), foreach=True, **kwargs), multi, grads)
    assert all(torch.equal(a, b) for a, b in zip(loop, multi))
    assert max_abs_diff(loop, base) > 1e-3


@pytest.mark.parametrize("cls,kwargs", [
    (Lamb, dict(lr=0.05, weight_decay=0.1, max_grad_norm=3.0)),
    (Lars, dict(lr=0.5, momentum=0.9, weight_decay=0.01, eeta=0.02)),
], ids=["lamb", "lars"])
def test_maximize_equals_negated_gradients(cls, kwargs):
    base = make_params()
    a, b = clone_params(base), clone_params(base)
    grads = grad_stream(steps=5)
    run_steps(cls(a, maximize=True, **kwargs), a, grads)
    run_steps(cls(b, **kwargs), b, [[-g for g in step] for step in grads])
    assert all(torch.equal(x, y) for x, y in zip(a, b))


# ---------------------------------------------------------------- FusedLamb
def test_fused_lamb_has_deepspeeds_signature():
    expected = [("lr", 1e-3), ("bias_correction", True), ("betas", (0.9, 0.999)), ("eps", 1e-8),
                ("eps_inside_sqrt", False), ("weight_decay", 0.0), ("max_grad_norm", 0.0),
                ("max_coeff", 10.0), ("min_coeff", 0.01), ("amsgrad", False)]
    positional = [p for p in inspect.signature(FusedLamb).parameters.values()
                  if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD][1:]  # after params
    assert [(p.name, p.default) for p in positional] == expected


def test_fused_lamb_refuses_amsgrad():
    with pytest.raises(ValueError, match="amsgrad"):
        FusedLamb(make_params(), amsgrad=True)
    with pytest.raises(TypeError, match="amsgrad"):
        FusedLamb(make_params(), amsgrad="yes")


@pytest.mark.parametrize("bias_correction", [True, False])
def test_fused_lamb_is_nvlamb_with_clamp(bias_correction):
    base = make_params(torch.float64)
    ours, ref_params = clone_params(base), clone_params(base)
    kwargs = dict(lr=0.05, eps=1e-8, weight_decay=0.0, bias_correction=bias_correction, min_coeff=0.05, max_coeff=2.0)
    opt = FusedLamb(ours, 0.05, bias_correction, eps=1e-8, weight_decay=0.0, min_coeff=0.05, max_coeff=2.0)
    ref = RefLAMB(ref_params, use_nvlamb=True, **kwargs)  # DeepSpeed: the trust ratio on every tensor
    ours_r, _ = _run_against_refs(opt, ours, [(ref, slice(None))], grad_stream(steps=STEPS))
    assert max_abs_diff(ours, ref_params) < 1e-10
    assert any(r != 1.0 for step in ours_r for r in step)
    assert opt.defaults["use_nvlamb"] and opt.defaults["decoupled_weight_decay"] and not opt.defaults["adam"]


def test_get_lamb_coeffs_lists_every_updated_param_in_group_order():
    params = make_params()
    opt = Lamb(two_groups(params, weight_decay=0.0), lr=0.05, weight_decay=0.1)
    assert opt.get_lamb_coeffs() == []
    params[0].grad = torch.ones_like(params[0])
    opt.step()
    assert len(opt.get_lamb_coeffs()) == 1  # only the stepped param
    run_steps(opt, params, grad_stream(steps=2))
    coeffs = opt.get_lamb_coeffs()
    assert len(coeffs) == 4 and all(isinstance(c, float) for c in coeffs)
    assert coeffs[2:] == [1.0, 1.0] and coeffs[0] != 1.0
    assert coeffs == [opt.state[p]["lamb_coeff"].item() for p in params]


# ---------------------------------------------------------------- Lars vs RefLARS
LARS_CASES = [
    dict(),
    dict(momentum=0.9),
    dict(momentum=0.9, weight_decay=0.01, eeta=0.02),
    dict(momentum=0.5, weight_decay=0.01, epsilon=0.5),
    dict(momentum=0.9, grad_clip=1.5, weight_decay=0.05),  # element-wise clamp hit
    dict(eeta=1.0, trust_clip=0.9),  # trust-ratio clamp hit
    dict(momentum=0.9, eeta=1.0, grad_clip=None, trust_clip=None),
]
LARS_B = dict(lr=0.2, momentum=0.7, eeta=0.005, weight_decay=0.001)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("foreach", [False, True], ids=["loop", "foreach"])
@pytest.mark.parametrize("flags", LARS_CASES, ids=str)
def test_lars_matches_reference_two_groups(flags, foreach, dtype):
    base = make_params(torch.float64)
    params, ref_params = clone_params(base, dtype), clone_params(base)
    kwargs = dict(lr=1.0, **flags) if flags.get("eeta") != 1.0 else dict(lr=0.02, **flags)
    opt = Lars(two_groups(params, **LARS_B), foreach=foreach, **kwargs)
    ref_b = {**{k: v for k, v in flags.items() if k in ("grad_clip", "trust_clip", "epsilon")}, **LARS_B}
    refs = [(RefLARS(ref_params[:2], **kwargs), slice(0, 2)), (RefLARS(ref_params[2:], **ref_b), slice(2, None))]
    grads = grad_stream(steps=STEPS)
    _run_against_refs(opt, params, refs, grads, change_lr_at=6)
    assert max_abs_diff(params, ref_params) < TOL[dtype]
    assert max_abs_diff(params, base) > 1e-3
    if flags.get("trust_clip"):
        assert flags["trust_clip"] in refs[0][0].last_trust_ratios or any(
            r == flags["trust_clip"] for r in refs[1][0].last_trust_ratios)
    if flags.get("grad_clip"):
        assert max(float((g + 0.05 * p.detach()).abs().max()) for g, p in zip(grads[0], base)) > flags["grad_clip"]


def test_lars_zero_param_and_zero_grad_get_trust_one():
    params = [torch.zeros(4, dtype=torch.float64), torch.ones(3, dtype=torch.float64)]
    params = [p.requires_grad_() for p in params]
    opt = Lars(params, lr=0.1, eeta=0.01, momentum=0.9)
    ref = RefLARS(clone_params(params), lr=0.1, eeta=0.01, momentum=0.9)
    grads = [torch.full((4,), 0.5, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)]
    for p, g in zip(params, grads):
        p.grad = g
    opt.step()
    ref.step(grads)
    assert ref.last_trust_ratios == [1.0, 1.0]
    assert torch.equal(params[0].detach(), torch.full((4,), -0.05, dtype=torch.float64))  # p - lr * 1 * g
    assert max_abs_diff(params, ref.params) < 1e-15


# ---------------------------------------------------------------- state dicts
def _round_trip(make_opt, dtype=torch.float32):
    base = make_params(dtype)
    grads = grad_stream(steps=10)
    full = clone_params(base)
    run_steps(make_opt(full), full, grads)
    first = clone_params(base)
    opt = make_opt(first)
    run_steps(opt, first, grads[:5])
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    resumed = clone_params(first)
    opt2 = make_opt(resumed)
    opt2.load_state_dict(torch.load(buf))
    for p, q in zip(first, resumed):
        for key, value in opt.state[p].items():
            saved = opt2.state[q][key]
            assert (saved == value) if key == "step" else (saved.dtype == value.dtype and torch.equal(saved, value))
    run_steps(opt2, resumed, grads[5:])
    return full, resumed


@pytest.mark.parametrize("make_opt,dtype", [
    (lambda p: Lamb(two_groups(p, weight_decay=0.0, lr=0.02), lr=0.05, weight_decay=0.1, max_grad_norm=3.0,
                    use_nvlamb=True, min_coeff=0.05, max_coeff=2.0), torch.float32),
    (lambda p: Lamb(two_groups(p, adam=True), lr=0.05, weight_decay=0.1, adam_w_mode=False), torch.float64),
    (lambda p: Lamb(p, lr=1e-2, weight_decay=0.1, fp32_state=True), torch.bfloat16),
    (lambda p: FusedLamb(p, lr=0.05, weight_decay=0.1, max_grad_norm=3.0), torch.float32),
    (lambda p: Lars(two_groups(p, momentum=0.5), lr=0.5, momentum=0.9, weight_decay=0.01, eeta=0.02), torch.float32),
    (lambda p: Lars(p, lr=0.5, momentum=0.9, eeta=0.02, fp32_state=True), torch.bfloat16),
], ids=["lamb", "lamb_adam_l2_fp64", "lamb_bf16_fp32_state", "fusedlamb", "lars", "lars_bf16_fp32_state"])
def test_state_dict_round_trip_continues_bit_identically(make_opt, dtype):
    full, resumed = _round_trip(make_opt, dtype)
    assert all(torch.equal(a, b) for a, b in zip(full, resumed))


def test_fp32_states_of_bf16_params_are_fp32():
    params = make_params(torch.bfloat16)
    opt = Lamb(params, lr=1e-2, fp32_state=True)
    run_steps(opt, params, grad_stream(steps=1))
    assert {opt.state[p][k].dtype for p in params for k in ("exp_avg", "exp_avg_sq", "lamb_coeff")} == {torch.float32}


# ---------------------------------------------------------------- release, accumulation
def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))


def test_lamb_clipping_refuses_gradient_release():
    model = _model()
    with pytest.raises(ValueError, match="max_grad_norm"):
        prepare_for_gradient_release(model, Lamb(model.parameters(), max_grad_norm=1.0))
    opt = Lamb(list(model.parameters())[:2])
    prepare_for_gradient_release(model, opt)  # no clipping: release works...
    with pytest.raises(ValueError, match="max_grad_norm"):  # ...and a clipped group cannot join later
        opt.add_param_group({"params": list(model.parameters())[2:], "max_grad_norm": 1.0})


@pytest.mark.parametrize("cls,kwargs", [
    (Lamb, dict(lr=0.05, weight_decay=0.1)),
    (Lars, dict(lr=0.5, momentum=0.9, weight_decay=0.01, eeta=0.02)),
])
def test_gradient_release_equals_normal_step(cls, kwargs):
    normal_model, release_model = _model(), _model()
    normal = cls(normal_model.parameters(), **kwargs)
    release = cls(release_model.parameters(), **kwargs)
    prepare_for_gradient_release(release_model, release)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, y = torch.randn(8, 5, generator=gen), torch.randn(8, 2, generator=gen)
        for model, opt in ((normal_model, normal), (release_model, release)):
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(normal_model.parameters(), release_model.parameters()))


def test_lars_accumulation_needs_momentum():
    with pytest.raises(ValueError, match="momentum"):
        Lars(make_params(), lr=0.1).optimizer_accumulation = True
    params = make_params()
    opt = Lars(params, lr=0.5, momentum=0.9, eeta=0.02)
    before = clone_params(params)
    opt.optimizer_accumulation = True
    run_steps(opt, params, grad_stream(steps=2))
    assert all(torch.equal(a, b) for a, b in zip(params, before))
    opt.optimizer_accumulation = False
    run_steps(opt, params, grad_stream(steps=1, seed=5))
    assert max_abs_diff(params, before) > 0


def test_lamb_accumulation_keeps_params_and_coeffs():
    params = make_params()
    opt = Lamb(params, lr=0.05, weight_decay=0.1)
    run_steps(opt, params, grad_stream(steps=1))
    before, coeffs = clone_params(params), opt.get_lamb_coeffs()
    opt.optimizer_accumulation = True
    run_steps(opt, params, grad_stream(steps=2, seed=4))
    assert all(torch.equal(a, b) for a, b in zip(params, before)) and opt.get_lamb_coeffs() == coeffs


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs,arg", [
    (dict(lr=-1.0), "lr"), (dict(betas=(1.0, 0.9)), "betas"), (dict(betas=(0.9,)), "betas"),
    (dict(eps=0.0), "eps"), (dict(eps=-1e-6), "eps"), (dict(weight_decay=-0.1), "weight_decay"),
    (dict(max_grad_norm=-1.0), "max_grad_norm"), (dict(max_grad_norm=float("nan")), "max_grad_norm"),
    (dict(max_coeff=0.0), "max_coeff"), (dict(max_coeff="10"), "max_coeff"),
    (dict(max_coeff=float("nan")), "max_coeff"),
    (dict(min_coeff=-0.1), "min_coeff"), (dict(min_coeff=20.0), "min_coeff"), (dict(min_coeff=math.inf), "min_coeff"),
    (dict(bias_correction="yes"), "bias_correction"), (dict(eps_inside_sqrt=1), "eps_inside_sqrt"),
    (dict(decoupled_weight_decay=None), "decoupled_weight_decay"), (dict(adam_w_mode=None), "decoupled_weight_decay"),
    (dict(grad_averaging="no"), "grad_averaging"),
    (dict(use_nvlamb=0), "use_nvlamb"), (dict(adam="x"), "adam"), (dict(maximize=1), "maximize"),
    (dict(foreach="y"), "foreach"), (dict(kahan_sum=1), "kahan_sum"), (dict(decouple_lr=True), "decouple_lr"),
])
def test_bad_lamb_arguments_name_the_argument(kwargs, arg):
    with pytest.raises((ValueError, TypeError), match=arg):
        Lamb(make_params(), **kwargs)


def test_bad_lamb_group_override_is_caught_in_the_constructor():
    with pytest.raises(ValueError, match="min_coeff"):
        Lamb(two_groups(make_params(), min_coeff=5.0), max_coeff=2.0)
    with pytest.raises(ValueError, match="lr"):
        FusedLamb(two_groups(make_params(), lr=-1.0))


@pytest.mark.parametrize("kwargs,arg", [
    (dict(lr=-1.0), "lr"), (dict(momentum=-0.1), "momentum"), (dict(trust_coefficient=0.0), "trust_coefficient"),
    (dict(trust_coefficient=1.5), "trust_coefficient"), (dict(eeta=1.5), "trust_coefficient"),
    (dict(weight_decay=-1.0), "weight_decay"), (dict(eps=-1e-8), "eps"), (dict(eps=math.inf), "eps"),
    (dict(epsilon=-1e-8), "eps"),
    (dict(grad_clip=0.0), "grad_clip"), (dict(grad_clip="a"), "grad_clip"), (dict(trust_clip=-1.0), "trust_clip"),
    (dict(foreach=1), "foreach"), (dict(decouple_lr=True), "decouple_lr"),
])
def test_bad_lars_arguments_name_the_argument(kwargs, arg):
    with pytest.raises((ValueError, TypeError), match=arg):
        Lars(make_params(), **kwargs)
