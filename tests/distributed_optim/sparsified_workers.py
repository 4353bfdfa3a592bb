"""What each gloo rank runs in the CentralizedSparsifiedSGD tests (module level, so ``spawn`` can pickle
it), and the deterministic setup the parent replays in the W-worker reference."""
from __future__ import annotations

import io

import torch
import torch.distributed as dist

from lightning_optim.comm import comm_stats, set_collective_timeout
from lightning_optim.distributed.sparsified import CentralizedSparsifiedSGD
from tests.distributed import error_text

SHAPES = [(5, 4), (7,), (2, 3, 2)]
DT = torch.float64
STEPS = 5
SPLIT = 3  # the resumed run stops after this many steps
COMMON = dict(lr=0.1, weight_decay=0.05, sparse_grad_size=3)
# name -> extra constructor arguments
CONFIGS = {
    "blockwise": dict(),
    "random": dict(random_sparse=True),
    "topk": dict(mode="topk"),
    "random_sum": dict(random_sparse=True, average_world=False),
}
MISSING = (2, 1, 1)  # (step, rank, param): that rank has no gradient for that param at that step


def init_params() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen, dtype=DT) for s in SHAPES]


def generator_seed(rank: int) -> int:
    return 10 + rank


def rank_grads(step: int, rank: int) -> list[torch.Tensor | None]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    grads = [torch.randn(s, generator=gen, dtype=DT) * (1 + rank) for s in SHAPES]
    if (step, rank) == MISSING[:2]:
        grads[MISSING[2]] = None
    return grads


def build(name: str, params, rank: int, world: int, group):
    return CentralizedSparsifiedSGD(params, **COMMON, **CONFIGS[name], world_size=world, process_group=group,
                                    generator=torch.Generator().manual_seed(generator_seed(rank)))


def _steps(opt, params, rank, steps) -> list[list[torch.Tensor]]:
    history = []
    for step in steps:
        for p, g in zip(params, rank_grads(step, rank)):
            p.grad = g
        opt.step()
        history.append([p.detach().clone() for p in params])
    return history


def _run(name: str, rank: int, world: int, group) -> dict:
    params = [p.requires_grad_() for p in init_params()]
    opt = build(name, params, rank, world, group)
    before = comm_stats().copy()
    history = _steps(opt, params, rank, range(1, STEPS + 1))
    delta = comm_stats() - before
    # resume: SPLIT steps, save (per rank), fresh objects, load, the remaining steps
    first = [p.requires_grad_() for p in init_params()]
    opt1 = build(name, first, rank, world, group)
    _steps(opt1, first, rank, range(1, SPLIT + 1))
    buf = io.BytesIO()
    torch.save({"params": [p.detach() for p in first], "opt": opt1.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    second = [p.clone().requires_grad_() for p in saved["params"]]
    opt2 = build(name, second, rank, world, group)
    opt2.load_state_dict(saved["opt"])
    resumed = _steps(opt2, second, rank, range(SPLIT + 1, STEPS + 1))
    memories = [opt.state[p]["memory"].clone() for p in params]
    return {"history": history, "resumed": resumed, "stats": delta.as_dict(), "memories": memories}


def suite(rank: int, world: int) -> dict:
    set_collective_timeout(30)
    pair = dist.new_group([0, 1])
    out: dict = {"two": {}, "three": {}}
    for name in CONFIGS:
        if rank < 2:
            out["two"][name] = _run(name, rank, 2, pair)
        out["three"][name] = _run(name, rank, 3, None)
    params = [p.requires_grad_() for p in init_params()]
    out["k_differs"] = error_text(lambda: CentralizedSparsifiedSGD(params, lr=0.1, sparse_grad_size=2 + rank, world_size=3))
    out["k_too_big_on_one"] = error_text(
        lambda: CentralizedSparsifiedSGD(params, lr=0.1, sparse_grad_size=8 if rank == 2 else 2, world_size=3))
    out["world_size_on_one"] = error_text(
        lambda: CentralizedSparsifiedSGD(params, lr=0.1, sparse_grad_size=2, world_size=2 if rank == 1 else 3))
    out["mode_differs"] = error_text(
        lambda: CentralizedSparsifiedSGD(params, lr=0.1, sparse_grad_size=2, random_sparse=rank == 0, world_size=3))

    def edited_after_construction():
        opt = CentralizedSparsifiedSGD(params, lr=0.1, sparse_grad_size=2, world_size=3)
        if rank == 1:
            opt.param_groups[0]["sparse_grad_size"] = 9
        for p in params:
            p.grad = torch.ones_like(p)
        before = [p.detach().clone() for p in params]
        try:
            opt.step()
        finally:  # nothing moved on any rank
            assert all(torch.equal(a, b) for a, b in zip(before, params))

    out["edited_group"] = error_text(edited_after_construction)
    return out
