"""What each gloo rank runs in the compressor tests (module level, so ``spawn`` can pickle it), and the
deterministic inputs the parent replays in the W-worker reference."""
from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_optim.comm import set_collective_timeout
from lightning_optim.comm.compressors import Blockwise, ErrorFeedback, PowerSGDCompressor, RandomK, ScaledSign, TopK
from lightning_optim.comm.stats import CommStats
from tests.distributed import error_text

SHAPES = [(6, 5), (7,), (3, 2, 2)]
STEPS = 4
DT = torch.float64

# name -> (class, kwargs, average)
CONFIGS = {
    "topk": (TopK, dict(k=4), True),
    "topk_ratio_sum": (TopK, dict(ratio=0.3), False),
    "randomk_shared": (RandomK, dict(k=3, seed=5), True),
    "randomk_own": (RandomK, dict(ratio=0.25, seed=5, shared_indices=False), True),
    "block_shared": (Blockwise, dict(k=3, seed=7), True),
    "block_own": (Blockwise, dict(k=2, seed=7, shared_indices=False), False),
    "sign": (ScaledSign, dict(), True),
    "majority": (ScaledSign, dict(majority_vote=True), True),
    "powersgd_r1": (PowerSGDCompressor, dict(rank=1), True),
    "powersgd_r4_reuse": (PowerSGDCompressor, dict(rank=4, reuse_query=True, seed=3), False),
}


def rank_inputs(step: int, rank: int) -> list[torch.Tensor]:
    """Rank ``rank``'s tensors at call ``step`` (1-based), different on every rank."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    return [torch.randn(s, generator=gen, dtype=DT) * (1 + rank) for s in SHAPES]


def _run(name: str, group) -> dict:
    cls, kwargs, average = CONFIGS[name]
    compressor = cls(**kwargs)
    feedback = ErrorFeedback()
    stats = CommStats()
    outs = []
    rank = dist.get_rank()
    for step in range(1, STEPS + 1):
        tensors = rank_inputs(step, rank)
        residuals = feedback.residuals(range(len(tensors)), tensors)
        outs.append([o.clone() for o in compressor.reduce(tensors, residuals, group=group, average=average, stats=stats)])
    world = dist.get_world_size(group)
    sizes = SHAPES if isinstance(compressor, PowerSGDCompressor) else [torch.Size(s).numel() for s in SHAPES]
    return {"outs": outs, "residuals": [feedback.residual(i, t).clone() for i, t in enumerate(rank_inputs(1, 0))],
            "stats": stats.as_dict(), "predicted": STEPS * compressor.bytes_sent(sizes, world, DT)}


def suite(rank: int, world: int) -> dict:
    set_collective_timeout(30)
    pair = dist.new_group([0, 1])
    out: dict = {"two": {}, "three": {}}
    for name in CONFIGS:
        if rank < 2:
            out["two"][name] = _run(name, pair)
        out["three"][name] = _run(name, None)
    tensors = rank_inputs(1, rank)
    # inconsistent settings across ranks: every rank must raise, none may hang
    out["k_differs"] = error_text(lambda: TopK(k=2 + rank).reduce(tensors))
    out["seed_differs"] = error_text(lambda: RandomK(k=2, seed=rank).reduce(tensors))
    out["rank_differs"] = error_text(lambda: PowerSGDCompressor(rank=1 + rank).reduce(tensors))
    out["layout_differs"] = error_text(lambda: ScaledSign().reduce(tensors[: 1 + (rank == 0)]))
    out["k_too_big_on_one"] = error_text(lambda: TopK(k=8 if rank == 1 else 2).reduce(tensors))
    # the group still works after those refusals
    out["after"] = ScaledSign().reduce([torch.ones(3, dtype=DT) * (rank + 1)])[0]
    return out
