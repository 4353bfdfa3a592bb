"""A one-element tensor lr (as torch.optim takes, for torch.compile with an LR scheduler): every optimizer of
the family steps with it exactly as with the float it holds, schedulers move it in place, checkpoints
keep it, bad tensors and the 1-bit optimizers refuse it; a compiled step reads it at run time (no
recompile when the scheduler changes it) and equals the eager step bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_optim
from lightning_optim import ops
from tests.ops.conftest import ext  # noqa: F401  (fixture: the built extension)
from tests.optim.specs import SPECS

LR32 = torch.tensor(1e-2)  # float32: its value as a double is not 1e-2


def train(opt_factory, lr, steps: int = 4, scheduler: bool = True) -> list[torch.Tensor]:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(6, 5)), nn.Parameter(torch.randn(5))]
    opt = opt_factory(params, lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if scheduler else None
    for i in range(steps):
        for p in params:
            p.grad = torch.sin(p.detach() * (i + 2))
        opt.step()
        if sched is not None:
            sched.step()
    return [p.detach() for p in params]


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_tensor_lr_steps_as_its_float(spec, backend, monkeypatch, ext):
    monkeypatch.setenv(ops.ENV_VAR, backend)
    kwargs = {k: v for k, v in spec.kwargs.items() if k != "lr"}

    def make(params, lr):
        return spec.cls(params, lr=lr, **kwargs)

    as_tensor = train(make, LR32.clone())
    as_float = train(make, LR32.item())
    for a, b in zip(as_tensor, as_float):
        assert torch.equal(a, b)
    assert not torch.equal(as_tensor[0], train(make, 2 * LR32.item())[0])  # the lr matters


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_scheduler_fills_the_tensor_and_checkpoints_keep_it(spec):
    kwargs = {k: v for k, v in spec.kwargs.items() if k != "lr"}
    lr = LR32.clone()
    opt = spec.cls([nn.Parameter(torch.randn(3))], lr=lr, **kwargs)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.param_groups[0]["params"][0].grad = torch.ones(3)
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] is lr and lr.item() == LR32.item() / 2  # in place, as torch's schedulers do
    state = copy.deepcopy(opt.state_dict())
    other = spec.cls([nn.Parameter(torch.randn(3))], lr=1.0, **kwargs)
    other.load_state_dict(state)
    assert torch.is_tensor(other.param_groups[0]["lr"]) and other.param_groups[0]["lr"].item() == lr.item()


BAD = {
    "two elements": (torch.tensor([1e-2, 1e-2]), ValueError),
    "integer": (torch.tensor(1), ValueError),
    "requires grad": (torch.tensor(1e-2, requires_grad=True), ValueError),
    "negative": (torch.tensor(-1e-2), ValueError),
    "nan": (torch.tensor(float("nan")), ValueError),
}


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("case", BAD)
def test_bad_tensor_lr_is_refused(spec, case):
    value, error = BAD[case]
    kwargs = {k: v for k, v in spec.kwargs.items() if k != "lr"}
    with pytest.raises(error, match="lr"):
        spec.cls([nn.Parameter(torch.randn(3))], lr=value, **kwargs)


@pytest.mark.parametrize("cls", [lightning_optim.OnebitAdam, lightning_optim.ZeroOneAdam, lightning_optim.OnebitLamb])
def test_onebit_optimizers_refuse_a_tensor_lr(cls):
    with pytest.raises(TypeError, match="lr: .* takes a float lr"):
        cls([nn.Parameter(torch.randn(3))], lr=torch.tensor(1e-3))


# ------------------------------------------------------------------ torch.compile
COMPILED = {
    "AdamW": (lightning_optim.AdamW, dict(weight_decay=0.1)),
    "AdamW decouple_lr": (lightning_optim.AdamW, dict(weight_decay=0.1, decouple_lr=True, max_lr=2e-2)),
    "SGD": (lightning_optim.SGD, dict(momentum=0.9)),
    "Lion": (lightning_optim.Lion, dict(weight_decay=0.1)),
}


def compiled_run(cls, kwargs, steps: int, compile_it: bool):
    from torch._dynamo.testing import CompileCounter

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = cls(model.parameters(), lr=LR32.clone(), **kwargs)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    x, y = torch.randn(12, 8), torch.randn(12, 4)

    def step():
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    counter = CompileCounter()
    fn = torch.compile(step, backend=counter) if compile_it else step
    frames = []
    for _ in range(steps):
        fn()
        sched.step()
        frames.append(counter.frame_count)
    return [p.detach() for p in model.parameters()], frames


needs_dynamo = pytest.mark.skipif(not torch._dynamo.is_dynamo_supported(),
                                  reason="torch.compile (dynamo) is not supported here")


@needs_dynamo
@pytest.mark.parametrize("lr_kind", ["tensor", "one-element tensor", "float"])
@pytest.mark.parametrize("name", COMPILED)
def test_compiled_step_with_a_scheduled_lr(name, lr_kind, ext, monkeypatch):
    """A scheduler changes the lr every step: the compiled step hands it to the op as a tensor (a float
    lr becomes a symbolic float after its first change), so no frame compiles after step 3, and the
    result equals the eager step's bit for bit."""
    monkeypatch.setenv(ops.ENV_VAR, "cpu")
    cls, kwargs = COMPILED[name]
    if lr_kind == "float":
        def cls(params, lr, _cls=cls, **kw):
            return _cls(params, lr=float(lr), **kw)
    elif lr_kind == "one-element tensor":  # shape (1,), as torch.optim takes too
        def cls(params, lr, _cls=cls, **kw):
            return _cls(params, lr=lr.reshape(1), **kw)
    torch._dynamo.reset()
    compiled, frames = compiled_run(cls, kwargs, steps=8, compile_it=True)
    eager, _ = compiled_run(cls, kwargs, steps=8, compile_it=False)
    for a, b in zip(compiled, eager):
        assert torch.equal(a, b)
    assert frames[3] == frames[-1], frames


@needs_dynamo
def test_the_recompile_check_sees_floats_passed_to_an_op(ext, monkeypatch):
    """The check above can fail: Adan still passes its lr-derived floats to its op, and recompiles."""
    monkeypatch.setenv(ops.ENV_VAR, "cpu")
    torch._dynamo.reset()
    _, frames = compiled_run(lightning_optim.Adan, {}, steps=8, compile_it=True)
    assert frames[-1] > frames[3], frames
