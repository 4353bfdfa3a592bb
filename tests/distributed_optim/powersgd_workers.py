"""What each gloo rank runs in the PowerSGD optimizer tests (module level, so ``spawn`` can pickle it), and
the deterministic setup the parent replays in the W-worker reference."""
from __future__ import annotations

import io

import torch
import torch.distributed as dist

from lightning_optim.comm import comm_stats, set_collective_timeout
from lightning_optim.distributed.powersgd import PowerSGD
from tests.distributed import error_text

SHAPES = [(6, 5), (5,), (4, 2, 2), (3,)]
DT = torch.float64
STEPS = 6
SPLIT = 3
# name -> (constructor arguments, world sizes it runs on)
CONFIGS = {
    "r1": (dict(lr=0.05, matrix_approximation_rank=1, momentum=0.9, weight_decay=0.01), (2, 3)),
    "r4": (dict(lr=0.05, matrix_approximation_rank=4, momentum=0.9, nesterov=True), (2,)),
    "r1_reuse": (dict(lr=0.05, matrix_approximation_rank=1, reuse_query=True, momentum=0.9, dampening=0.1, seed=7),
                 (2,)),
    "r4_reuse": (dict(lr=0.05, matrix_approximation_rank=4, reuse_query=True, momentum=0.5, weight_decay=0.02),
                 (2, 3)),
    "r4_reuse_by_layer": (dict(lr=0.05, matrix_approximation_rank=4, reuse_query=True, momentum=0.5,
                               weight_decay=0.02, by_layer=True), (2,)),
    "r2_sum": (dict(lr=0.02, matrix_approximation_rank=2, average_world=False), (2,)),
}
MISSING = (2, 1, 0)  # (step, rank, param): that rank has no gradient for that param at that step


def init_params() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen, dtype=DT) for s in SHAPES]


def rank_grads(step: int, rank: int) -> list[torch.Tensor | None]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    grads = [torch.randn(s, generator=gen, dtype=DT) * (1 + rank) for s in SHAPES]
    if (step, rank) == MISSING[:2]:
        grads[MISSING[2]] = None
    return grads


def _steps(opt, params, rank, steps):
    history = []
    for step in steps:
        for p, g in zip(params, rank_grads(step, rank)):
            p.grad = None if g is None else g.clone()
        opt.step()
        history.append([p.detach().clone() for p in params])
    return history


def _run(name: str, rank: int, world: int, group) -> dict:
    kwargs = CONFIGS[name][0]
    params = [p.requires_grad_() for p in init_params()]
    opt = PowerSGD(params, **kwargs, world_size=world, process_group=group)
    before = comm_stats().copy()
    history = _steps(opt, params, rank, range(1, STEPS + 1))
    delta = comm_stats() - before
    first = [p.requires_grad_() for p in init_params()]
    opt1 = PowerSGD(first, **kwargs, world_size=world, process_group=group)
    _steps(opt1, first, rank, range(1, SPLIT + 1))
    buf = io.BytesIO()
    torch.save({"params": [p.detach() for p in first], "opt": opt1.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    second = [p.clone().requires_grad_() for p in saved["params"]]
    opt2 = PowerSGD(second, **kwargs, world_size=world, process_group=group)
    opt2.load_state_dict(saved["opt"])
    resumed = _steps(opt2, second, rank, range(SPLIT + 1, STEPS + 1))
    return {"history": history, "resumed": resumed, "stats": delta.as_dict(),
            "memories": [opt.state[p]["memory"].clone() for p in params]}


def suite(rank: int, world: int) -> dict:
    set_collective_timeout(30)
    pair = dist.new_group([0, 1])
    out: dict = {2: {}, 3: {}}
    for name, (_, worlds) in CONFIGS.items():
        if 2 in worlds and rank < 2:
            out[2][name] = _run(name, rank, 2, pair)
        if 3 in worlds:
            out[3][name] = _run(name, rank, 3, None)
    params = [p.requires_grad_() for p in init_params()]
    out["rank_differs"] = error_text(lambda: PowerSGD(params, lr=0.1, matrix_approximation_rank=1 + rank,
                                                      world_size=3))
    out["seed_differs"] = error_text(lambda: PowerSGD(params, lr=0.1, seed=rank, world_size=3))
    out["rank_zero_on_one"] = error_text(lambda: PowerSGD(params, lr=0.1, world_size=3,
                                                          matrix_approximation_rank=0 if rank == 2 else 1))
    out["world_size_on_one"] = error_text(lambda: PowerSGD(params, lr=0.1, world_size=1 if rank == 0 else 3))
    out["model_differs"] = error_text(lambda: PowerSGD(params[: 3 + (rank == 1)], lr=0.1, world_size=3))
    return out
