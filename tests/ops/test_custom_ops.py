"""The compiled kernels as torch custom ops: every op passes torch.library.opcheck,
the op gives the binding's result bit for bit, a compiled training step equals the eager one, and
torch.compile traces our optimizer step without a graph break in lightning_optim."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import lightning_optim
from lightning_optim import ops
from lightning_optim.ops import fused
from lightning_optim.ops.custom_ops import OP_NAMES, op
from lightning_optim.ops.graph_breaks import explain_breaks

SHAPES = [(3, 5), (7,)]

needs_dynamo = pytest.mark.skipif(not torch._dynamo.is_dynamo_supported(),
                                  reason="torch.compile (dynamo) is not supported on this Python/platform")
# torch 2.11's dynamo cannot trace id() of a dict (the plan cache's key, optim/plans.py): one graph break per
# step there (seen on the GPU image), a slower step, not a different result; 2.13 traces it.
needs_dynamo_2_13 = pytest.mark.skipif(torch.__version__ < (2, 13), reason="dynamo before 2.13 breaks at id(group)")


def tensors(dtype: torch.dtype, seed: int, positive: bool = False) -> list[Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = [torch.randn(s, generator=gen).to(dtype) for s in SHAPES]
    return [t.abs() + 0.1 for t in out] if positive else out


def fp32(seed: int, positive: bool = False) -> list[Tensor]:
    return tensors(torch.float32, seed, positive)


def per_tensor(value: float) -> Tensor:
    return torch.full((len(SHAPES),), value, dtype=torch.float32)


def sample_args(name: str, dtype: torch.dtype) -> dict[str, Any]:
    """Arguments of the op ``name`` over params of ``dtype`` (fp32 states; Kahan buffers for 16-bit params)."""
    params, grads = tensors(dtype, 0), tensors(dtype, 1)
    comps = tensors(dtype, 2) if dtype != torch.float32 else []
    decay = dict(keep=0.999, neg_decay=-0.001)
    rule = dict(wd=0.1, max_lr=0.02)  # the compiled-step variants: decay = wd * lr / max_lr
    samples: dict[str, Callable[[], dict[str, Any]]] = {
        "adam": lambda: dict(params=params, grads=grads, exp_avgs=fp32(3), exp_avg_sqs=fp32(4, True),
                             max_exp_avg_sqs=fp32(5, True), kahan_comps=comps,
                             param_copies=tensors(torch.bfloat16, 6) if dtype == torch.float32 else [], w1=0.1,
                             beta2=0.999, c2=0.001, step=-0.01, sqrt_bc2=0.5, eps=1e-8, l2=0.0, apply=True, **decay),
        "adam_at_step": lambda: dict(params=params, grads=grads, exp_avgs=fp32(3), exp_avg_sqs=fp32(4, True),
                                     max_exp_avg_sqs=[], kahan_comps=comps, param_copies=[], w1=0.1, beta1=0.9,
                                     beta2=0.999, c2=0.001, lr=torch.tensor(1e-2), count=3, eps=1e-8, l2=0.01,
                                     apply=True, **rule),
        "sgd_at_lr": lambda: dict(params=params, grads=grads, momentum_buffers=fp32(3), kahan_comps=comps,
                                  momentum=0.9, damp_keep=1.0, l2_pre=0.01, l2_post=0.0, lr=torch.tensor(0.1),
                                  first=False, nesterov=True, apply=True, **rule),
        "lion_at_lr": lambda: dict(params=params, grads=grads, exp_avgs=fp32(3), kahan_comps=comps, w1=0.1, w2=0.01,
                                   lr=torch.tensor(1e-3, dtype=torch.float64), apply=True, **rule),
        "sgd": lambda: dict(params=params, grads=grads, momentum_buffers=fp32(3), kahan_comps=comps, momentum=0.9,
                            damp_keep=1.0, l2_pre=0.01, l2_post=0.0, neg_lr=-0.1, first=False, nesterov=True,
                            apply=True, **decay),
        "lion": lambda: dict(params=params, grads=grads, exp_avgs=fp32(3), kahan_comps=comps, w1=0.1, w2=0.01,
                             neg_lr=-1e-3, apply=True, **decay),
        "adan": lambda: dict(params=params, grads=grads, exp_avgs=fp32(3), exp_avg_diffs=fp32(4),
                             exp_avg_sqs=fp32(5, True), prev_grads=fp32(6), kahan_comps=comps, w1=0.02, w2=0.08,
                             beta2=0.92, beta3=0.99, c3=0.01, bc1=0.5, n_coef=1.2, sqrt_bc3=0.4, eps=1e-8,
                             step=1e-3, first=False, apply=True, **decay),
        "lamb_moments": lambda: dict(params=params, grads=grads, exp_avgs=fp32(3), exp_avg_sqs=fp32(4, True),
                                     clip_div=1.0, l2=0.0, beta1=0.9, m_coef=0.1, beta2=0.999, c2=0.001, bc1=0.5,
                                     bc2=0.25, eps=1e-6, wd=0.01, eps_inside_sqrt=False, norms=True),
        "lamb_apply": lambda: dict(params=params, exp_avgs=fp32(3), exp_avg_sqs=fp32(4, True), kahan_comps=comps,
                                   scales=per_tensor(-1e-3), bc1=0.5, bc2=0.25, eps=1e-6, wd=0.01,
                                   eps_inside_sqrt=False),
        "lars_norms": lambda: dict(params=params, grads=grads),
        "lars": lambda: dict(params=params, grads=grads, momentum_buffers=fp32(3), kahan_comps=comps,
                             scales=per_tensor(0.01), wd=1e-4, lo_clip=-1.0, hi_clip=1.0, momentum=0.9, first=False,
                             apply=True),
        "stable_moments": lambda: dict(params=params, grads=grads, exp_avgs=fp32(3), exp_avg_sqs=fp32(4, True),
                                       w1=0.1, beta2=0.99, c2=0.01, bc2=0.5, eps_sq=1e-16, rms=True),
        "stable_apply": lambda: dict(params=params, exp_avgs=fp32(3), exp_avg_sqs=fp32(4, True), kahan_comps=comps,
                                     scales=per_tensor(-1e-3), keeps=per_tensor(0.999), neg_decays=per_tensor(-1e-3),
                                     bc2=0.5, eps=1e-8),
    }
    return samples[name]()


def by_binding(ext: Any, name: str, args: dict[str, Any]) -> Any:
    """The binding the op wraps, called as the eager optimizer path calls it (for the compiled-step
    variants: the scalars worked out from the count and the lr as Adam/SGD/Lion._update and fused do)."""
    if name not in ("adam_at_step", "sgd_at_lr", "lion_at_lr"):
        return getattr(ext, name)(**args)
    lr = float(args["lr"])
    decay = fused.decay_coefficient(lr, args["wd"], args["max_lr"])
    rest = {k: v for k, v in args.items() if k not in ("beta1", "lr", "count", "wd", "max_lr")}
    rest.update(keep=1 - decay, neg_decay=-decay)
    if name == "sgd_at_lr":
        return ext.sgd(**rest, neg_lr=-lr)
    if name == "lion_at_lr":
        return ext.lion(**rest, neg_lr=-lr)
    bc1, bc2 = 1 - args["beta1"] ** args["count"], 1 - args["beta2"] ** args["count"]
    return ext.adam(**rest, step=-lr / bc1, sqrt_bc2=math.sqrt(bc2))


def copied(args: dict[str, Any]) -> dict[str, Any]:
    return {k: [t.clone() for t in v] if isinstance(v, list) else v.clone() if isinstance(v, Tensor) else v
            for k, v in args.items()}


def tensors_of(args: dict[str, Any], result: Any) -> list[Tensor]:
    out = [t for v in args.values() for t in (v if isinstance(v, list) else [v]) if isinstance(t, Tensor)]
    return out + ([result] if isinstance(result, Tensor) else [])


def test_every_list_kernel_has_a_custom_op():
    assert set(OP_NAMES) == {"adam", "adam_at_step", "sgd", "sgd_at_lr", "lion", "lion_at_lr", "adan", "lamb_moments", "lamb_apply",
                             "lars_norms", "lars", "stable_moments", "stable_apply"}
    for name in OP_NAMES:
        assert getattr(torch.ops.lightning_optim, name).default is op(name)._opoverload


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", OP_NAMES)
def test_opcheck(ext, name, dtype):
    torch.library.opcheck(op(name), (), sample_args(name, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", OP_NAMES)
def test_op_equals_the_binding_bitwise(ext, name, dtype):
    args = sample_args(name, dtype)
    direct = copied(args)
    got = getattr(torch.ops.lightning_optim, name)(**args)
    want = by_binding(ext, name, direct)
    for a, b in zip(tensors_of(args, got), tensors_of(direct, want), strict=True):
        assert torch.equal(a, b)
    untouched = sample_args(name, dtype)
    wrote = any(not torch.equal(a, b) for a, b in zip(tensors_of(args, None), tensors_of(untouched, None)))
    assert wrote or isinstance(got, Tensor), f"{name}: the sample arguments did not exercise the kernel"


def tiny_step(opt_cls: Callable[..., torch.optim.Optimizer], **kwargs: Any) -> tuple[Callable[[], None], nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = opt_cls(model.parameters(), **kwargs)
    x, y = torch.randn(5, 8), torch.randn(5, 4)

    def step_fn() -> None:
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    return step_fn, model


# name -> (class, arguments, the custom op its step runs)
OPTIMIZERS = {
    "AdamW": (lightning_optim.AdamW, dict(lr=1e-2, weight_decay=0.1), "adam_at_step"),
    "SGD": (lightning_optim.SGD, dict(lr=1e-2, momentum=0.9), "sgd_at_lr"),
    "Lion": (lightning_optim.Lion, dict(lr=1e-3, weight_decay=0.1), "lion_at_lr"),
    "StableAdamW": (lightning_optim.StableAdamW, dict(lr=1e-2, weight_decay=0.1), "stable_moments stable_apply"),
}


RECOMPILE_CHECKED = ["AdamW", "SGD", "Lion"]  # StableAdamW: its ops take float bias corrections


@functools.cache
def compiled_training(name: str) -> tuple[list[Tensor], list[int]]:
    """Three compiled steps of ``name``'s tiny model (eight where the recompile test checks it), traced afresh:
    the params after step 3 and the frames compiled by each step. One trace serves both tests below (it is
    most of their time); CompileCounter runs the graph as backend="eager" does (``gm.forward``)."""
    from torch._dynamo.testing import CompileCounter

    cls, kwargs, _ = OPTIMIZERS[name]
    step_fn, model = tiny_step(cls, **kwargs)
    counter = CompileCounter()
    compiled = torch.compile(step_fn, backend=counter)
    torch._dynamo.reset()
    params, frames = [], []
    for i in range(8 if name in RECOMPILE_CHECKED else 3):
        compiled()
        frames.append(counter.frame_count)
        if i == 2:
            params = [p.detach().clone() for p in model.parameters()]
    return params, frames


@needs_dynamo
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_compiled_step_equals_eager_bitwise(ext, use_backend, name):
    use_backend("cpu")
    cls, kwargs, _ = OPTIMIZERS[name]
    eager_fn, eager_model = tiny_step(cls, **kwargs)
    for _ in range(3):
        eager_fn()
    compiled_params, _ = compiled_training(name)
    for p, q in zip(eager_model.parameters(), compiled_params):
        assert torch.equal(p, q)
    assert not torch.equal(eager_model[0].weight, tiny_step(cls, **kwargs)[1][0].weight)  # it did train


def explain(step_fn: Callable[[], None]) -> tuple[list[str], set[str]]:
    """The graph breaks at or through lightning_optim, and the custom ops in the traced graphs."""
    out, breaks = explain_breaks(step_fn)
    ours = [f"{b.where}: {b.reason}" for b in breaks if b.in_lightning_optim]
    ops_seen = {str(node.target) for graph in out.graphs for node in graph.graph.nodes
                if str(node.target).startswith("lightning_optim.")}
    return ours, ops_seen


@needs_dynamo
@needs_dynamo_2_13
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_no_graph_break_in_lightning_optim(ext, use_backend, name):
    use_backend("cpu")
    cls, kwargs, op_name = OPTIMIZERS[name]
    step_fn, _ = tiny_step(cls, **kwargs)
    step_fn()  # the states exist: the step every later iteration compiles
    breaks, ops_seen = explain(step_fn)
    assert breaks == []
    assert ops_seen == {f"lightning_optim.{name}" for name in op_name.split()}  # in the graph, not skipped


@needs_dynamo
@pytest.mark.parametrize("name", RECOMPILE_CHECKED)
def test_later_steps_do_not_recompile(ext, use_backend, name):
    """The step count changes every step: it must reach the graph symbolically, not as a constant."""
    use_backend("cpu")
    _, frames = compiled_training(name)
    # steps 1-3: the first step, then the one where the step count turns dynamic; none compiles in 4-8
    assert len(frames) == 8 and frames[-1] == frames[2], frames


@needs_dynamo
@needs_dynamo_2_13
def test_the_break_check_sees_a_break_in_lightning_optim(ext, use_backend, monkeypatch):
    """The check above can fail: the step as it was before the custom ops (pybind calls) is caught."""
    use_backend("cpu")
    step_fn, _ = tiny_step(lightning_optim.Adan, lr=1e-2)  # its kernel goes through launch
    step_fn()
    assert explain(step_fn)[0] == []  # without the patch: no break
    monkeypatch.setattr(fused, "launch", lambda ext, name, **kwargs: getattr(ext, name)(**kwargs))
    breaks, _ = explain(step_fn)
    assert any("marked as skipped" in b for b in breaks), breaks  # the pybind kernel, called from our step


def test_eager_step_does_not_use_the_dispatcher(ext, use_backend, monkeypatch):
    """Eager steps call the binding directly (boxing thousands of tensors costs more than the kernel)."""
    use_backend("cpu")
    called = []
    monkeypatch.setattr(torch.ops.lightning_optim, "adam", lambda **kw: called.append(kw), raising=False)
    step_fn, _ = tiny_step(lightning_optim.AdamW)
    step_fn()
    assert called == []
    assert ops.backend_for("cpu") == "cpu"


def test_the_constant_mark_is_torchs_own():
    """``ops`` marks its backend lookup as dynamo's ``assume_constant_result`` does, without importing dynamo at
    import time: the same attributes on the function (a torch that marks differently fails here)."""
    from lightning_optim.ops import _constant_while_tracing

    def ours():
        return "cpu"

    def torchs():
        return "cpu"

    assert vars(_constant_while_tracing(ours)) == vars(torch.compiler.assume_constant_result(torchs)) != {}
