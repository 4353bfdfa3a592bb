"""What each gloo rank runs in the centralized-optimizer tests (module level, so ``spawn`` can pickle
it), and the deterministic setup the parent replays in the W-worker reference
(tests/reference/centralized.py).

A spec names a class, its local optimizer's hyper-parameters and the centralized flags; every spec
runs flat and ``by_layer``. Gradients are synthetic (seeded by spec, step and rank: different on
every rank, independent of the params), so the reference can rebuild them.
"""

from __future__ import annotations

import io

import torch
from torch import nn

from lightning_optim.comm import comm_stats, set_collective_timeout
from lightning_optim.distributed.centralized import (
    CentralizedAdam,
    CentralizedSGD,
    CustomCentralizedOptimizer,
    GenericCentralizedOptimizer,
)
from tests.ranks import seeded

SHAPES = [(4, 3), (3,), (2, 2, 2), (5,)]
STEPS = 4
SGD_KW = dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01)
ADAM_KW = dict(lr=0.01, betas=(0.8, 0.99), eps=1e-8, weight_decay=0.01)

# name: (kind, local optimizer (torch.optim name for generic/custom), its kwargs, centralized flags, extras)
SPECS = {
    "sgd": ("sgd", "sgd", SGD_KW, {}, {}),
    "sgd_nesterov": ("sgd", "sgd", dict(lr=0.05, momentum=0.8, nesterov=True), {}, {}),
    "sgd_weights": ("sgd", "sgd", SGD_KW, dict(agg_grad=False), {}),
    "sgd_steplr": ("sgd", "sgd", SGD_KW, {}, dict(scheduler=True)),
    "sgd_missing": ("sgd", "sgd", SGD_KW, {}, dict(missing=True)),
    "sgd_fp32": ("sgd", "sgd", SGD_KW, {}, dict(dtype=torch.float32)),
    "adam": ("adam", "adam", ADAM_KW, {}, {}),
    "adam_amsgrad": ("adam", "adam", dict(ADAM_KW, amsgrad=True), {}, {}),
    "adam_weights": ("adam", "adam", ADAM_KW, dict(agg_grad=False), {}),
    "generic_divide_before": ("generic", "SGD", dict(lr=0.1, momentum=0.5), dict(divide_before=True), {}),
    "generic_weights": ("generic", "Adam", dict(lr=0.01), dict(agg_grad=False, divide_before=True), {}),
    "custom_world_clip": ("custom", "Adam", dict(lr=0.01), dict(average_world=True, grad_clip=0.5), {}),
    "custom_denom": ("custom", "SGD", dict(lr=0.1, momentum=0.9), dict(average_custom=True), {}),
    "custom_denom_before": ("custom", "SGD", dict(lr=0.1), dict(average_custom=True, divide_before=True), {}),
    "custom_denom_before_clip": ("custom", "SGD", dict(lr=0.1), dict(average_custom=True, divide_before=True,
                                                                     grad_clip=0.7), dict(missing=True)),
    "custom_sum_clip": ("custom", "RMSprop", dict(lr=0.01), dict(grad_clip=1.5), {}),
    "custom_sum": ("custom", "SGD", dict(lr=0.02), {}, {}),
    "custom_weights": ("custom", "Adagrad", dict(lr=0.1), dict(agg_grad=False, average_world=True), {}),
    "custom_bf16": ("custom", "SGD", dict(lr=0.1), dict(average_world=True), dict(dtype=torch.bfloat16)),
    "custom_weights_bf16": ("custom", "SGD", dict(lr=0.1, momentum=0.5), dict(agg_grad=False, average_world=True),
                            dict(dtype=torch.bfloat16)),
}


class ParamModel(nn.Module):
    """A model that is only its params (the tests set the gradients directly)."""

    def __init__(self, dtype: torch.dtype = torch.float64, seed: int = 0) -> None:
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(p.to(dtype)) for p in initial_params(seed))


def initial_params(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES]


def init_seed(name: str, rank: int) -> int:
    """Weights-averaging specs start every rank elsewhere (mlbench averages them at construction)."""
    return 100 + rank if not SPECS[name][3].get("agg_grad", True) else 0


def rank_grads(name: str, step: int, rank: int) -> list[torch.Tensor | None]:
    """Rank ``rank``'s float64 gradients at ``step`` (1-based). With ``missing``: param 1 has none on
    rank 0 at steps 2-3, param 3 has none anywhere (it must stay untouched)."""
    gen = torch.Generator().manual_seed(10_000 * list(SPECS).index(name) + 100 * step + rank)
    grads = [torch.randn(s, generator=gen, dtype=torch.float64) * (1 + rank) for s in SHAPES]
    if SPECS[name][4].get("missing"):
        if rank == 0 and step in (2, 3):
            grads[1] = None
        grads[3] = None
    return grads


def denom_at(step: int) -> float:
    """average_custom's denominator at ``step``: the same on every rank, changing per step."""
    return 2.5 + step


def build(name: str, model: nn.Module, by_layer: bool, world_size=None):
    kind, local, local_kw, flags, _ = SPECS[name]
    if kind == "sgd":
        return CentralizedSGD(world_size, model, **local_kw, **flags, by_layer=by_layer)
    if kind == "adam":
        return CentralizedAdam(world_size, model, **local_kw, **flags, by_layer=by_layer)
    inner = getattr(torch.optim, local)(model.parameters(), **local_kw)
    if kind == "generic":
        return GenericCentralizedOptimizer(world_size, model, **flags, by_layer=by_layer, optimizer=inner)
    return CustomCentralizedOptimizer(model, world_size, inner, **flags, by_layer=by_layer)


def scheduler_for(name: str, opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if SPECS[name][4].get("scheduler") else None


def _step(name: str, opt, model: nn.Module, step: int, rank: int) -> None:
    for p, g in zip(model.weights, rank_grads(name, step, rank)):
        p.grad = None if g is None else g.to(p.dtype)
    if SPECS[name][3].get("average_custom"):
        d = denom_at(step)
        opt.step(denom=torch.tensor(d) if step % 2 == 0 else d)  # a tensor or a number, as mlbench's callers do
    else:
        opt.step()


def run_specs(rank: int, world: int, names: list[str]) -> dict:
    """Every spec, flat and by layer: per step the params, the gradients the local step saw, the bytes."""
    set_collective_timeout(60)
    out = {}
    for name in names:
        for by_layer in (False, True):
            dtype = SPECS[name][4].get("dtype", torch.float64)
            model = ParamModel(dtype, init_seed(name, rank))
            before = comm_stats().copy()
            opt = build(name, model, by_layer)
            sched = scheduler_for(name, opt)
            setup_bytes = (comm_stats() - before).bytes_sent
            params, grads, sent, lrs = [], [], [], []
            for step in range(1, STEPS + 1):
                before = comm_stats().copy()
                _step(name, opt, model, step, rank)
                sent.append((comm_stats() - before).as_dict())
                lrs.append(opt.param_groups[0]["lr"])
                if sched is not None:
                    sched.step()
                params.append([p.detach().clone() for p in model.weights])
                grads.append([None if p.grad is None else p.grad.clone() for p in model.weights])
            out[name, by_layer] = dict(params=params, grads=grads, sent=sent, lrs=lrs, setup_bytes=setup_bytes)
    return out


RESUME = ["sgd_steplr", "adam", "generic_weights", "custom_denom_before_clip", "sgd_weights", "custom_weights"]


def _to_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _from_bytes(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=True)


def _fresh(name: str, rank: int, by_layer: bool, seed: int | None = None):
    model = ParamModel(SPECS[name][4].get("dtype", torch.float64), init_seed(name, rank) if seed is None else seed)
    opt = build(name, model, by_layer)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def run_resume(rank: int, world: int, names: list[str], steps: int = 6, cut: int = 3) -> dict:
    """Uninterrupted vs saved at ``cut`` and restored into a fresh model/optimizer/StepLR (built
    first, then loaded, as a training script does): final params, states and lr, per rank."""
    set_collective_timeout(60)
    out = {}
    for name in names:
        for by_layer in (False, True):
            model, opt, sched = _fresh(name, rank, by_layer)
            for step in range(1, steps + 1):
                _step(name, opt, model, step, rank)
                sched.step()
            straight = (_to_bytes(model.state_dict()), _to_bytes(opt.state_dict()), opt.param_groups[0]["lr"])

            model, opt, sched = _fresh(name, rank, by_layer)
            for step in range(1, cut + 1):
                _step(name, opt, model, step, rank)
                sched.step()
            saved = [_to_bytes(model.state_dict()), _to_bytes(opt.state_dict()), _to_bytes(sched.state_dict())]
            model, opt, sched = _fresh(name, rank, by_layer, seed=999)  # other weights: the load must restore them
            model.load_state_dict(_from_bytes(saved[0]))
            opt.load_state_dict(_from_bytes(saved[1]))
            sched.load_state_dict(_from_bytes(saved[2]))
            for step in range(cut + 1, steps + 1):
                _step(name, opt, model, step, rank)
                sched.step()
            resumed = (_to_bytes(model.state_dict()), _to_bytes(opt.state_dict()), opt.param_groups[0]["lr"])
            out[name, by_layer] = dict(straight=straight, resumed=resumed, inner_lr=opt.optimizer.param_groups[0]["lr"])
    return out


class CountingTracker:
    """mlbench's Tracker interface, counting the calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def record_batch_agg(self) -> None:
        self.calls.append("agg")

    def record_batch_opt_step(self) -> None:
        self.calls.append("opt")


TRAIN_KINDS = ["sgd", "adam", "weights", "custom"]


def train_tiny_all(rank: int, world: int) -> dict:
    """``train_tiny`` for every kind, in one launch."""
    set_collective_timeout(60)
    return {kind: train_tiny(rank, world, kind) for kind in TRAIN_KINDS}


def train_tiny(rank: int, world: int, kind: str, steps: int = 40) -> dict:
    """A small regression net, different data on every rank, real backward through a closure: the
    losses on this rank's data, the final params and the tracker's calls."""
    with seeded(0):  # the same initial model everywhere
        model = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 1))
    gen = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(32, 6, generator=gen)
    y = x @ torch.linspace(-1, 1, 6).unsqueeze(1) + 0.1 * torch.randn(32, 1, generator=gen)
    if kind == "sgd":
        opt = CentralizedSGD(world, model, lr=0.05, momentum=0.9)
    elif kind == "adam":
        opt = CentralizedAdam(None, model, lr=0.02, by_layer=True)
    elif kind == "weights":
        opt = CentralizedSGD(None, model, lr=0.05, momentum=0.9, agg_grad=False)
    else:  # summed loss divided by the global sample count: a global mean
        opt = CustomCentralizedOptimizer(model, world, torch.optim.Adam(model.parameters(), lr=0.02),
                                         average_custom=True, grad_clip=5.0)
    tracker = CountingTracker()

    def closure():
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y, reduction="sum" if kind == "custom" else "mean")
        loss.backward()
        return loss

    losses = []
    for _ in range(steps):
        if kind == "custom":
            loss = opt.step(closure, tracker=tracker, denom=torch.tensor(float(world * len(x))))
            losses.append(float(loss) / len(x))
        else:
            losses.append(float(opt.step(closure, tracker=tracker)))
    with torch.no_grad():
        final = float(nn.functional.mse_loss(model(x), y))
    return dict(losses=losses + [final], params=[p.detach().clone() for p in model.parameters()],
                calls=tracker.calls)
