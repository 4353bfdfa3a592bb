"""What each gloo rank runs in the SparseLoCo tests (``test_sparseloco.py``): the compressor's ``reduce`` alone over
several calls, and DiLoCo with ``compressor="sparseloco"`` (or a SparseLoCo instance) past four synchronisations and
more, with a checkpoint mid-run resumed in fresh objects, and the end of a run. The model, data and inner optimizers
are ``diloco_workers``' (the parent replays them in the W-worker reference)."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_optim.comm import comm_stats, set_collective_timeout
from lightning_optim.comm.compressors import SparseLoCo
from lightning_optim.comm.stats import CommStats
from lightning_optim.distributed import DiLoCo
from lightning_optim.distributed.diloco_schedule import syncing_fragment
from tests.distributed import error_text
from tests.distributed_optim.diloco_workers import (
    _steps,
    counting_collectives,
    init_params,
    make_inner,
    resumed_run,
)

STEPS = 12
PAPER_CHUNK = 4096  # SparseLoCo's chunk, which compressor="sparseloco" takes
# name -> ranks (3, or 2: a pair subgroup of the 3), DiLoCo keywords, a SparseLoCo instance's keywords (None: the
# name with DiLoCo's density/bits), the step after which a checkpoint is taken (between syncs; with overlap, an
# exchange still to merge), and the step a second run ends at with finish() (None: no such run)
CONFIGS: dict[str, dict[str, Any]] = {
    "name_one_chunk": dict(world=3, kw=dict(sync_every=3, compressor="sparseloco", density=0.25, bits=2,
                                            outer_lr=0.8, outer_momentum=0.9), split=7, finish=11),
    "bits1_chunks_fragments": dict(world=3, kw=dict(sync_every=4, fragments=2, outer_lr=1.0, nesterov=False),
                                   instance=dict(density=0.3, bits=1, chunk=8, decay=0.8), split=7, finish=None),
    "bits3_overlap_pair": dict(world=2, kw=dict(sync_every=3, overlap=True, mixing=0.25, compressor="sparseloco",
                                                density=0.5, bits=3, outer_lr=0.9, outer_momentum=1.0),
                               split=6, finish=None),
    "streaming_chunks": dict(world=3, inner="adamw", kw=dict(sync_every=4, fragments=2, overlap=True, outer_lr=0.7),
                             instance=dict(density=0.2, bits=2, chunk=7, decay=0.95), split=6, finish=10),
    "bits4_pair": dict(world=2, kw=dict(sync_every=2, compressor="sparseloco", density=0.15, bits=4, outer_lr=1.0,
                                        outer_momentum=0.5, nesterov=False), split=5, finish=None),
}
# the compressor alone: name -> (SparseLoCo keywords, dtype, average)
REDUCE = {
    "paper_bits_fp32": (dict(density=0.1, bits=2, chunk=9, decay=0.95), torch.float32, True),
    "bits1_sum": (dict(density=0.25, bits=1, chunk=6, decay=1.0), torch.float64, False),
    "bits8_no_decay": (dict(density=0.5, bits=8, chunk=16, decay=0.0), torch.float64, True),
}
REDUCE_SHAPES = [(6, 5), (7,), (3, 2, 2)]
REDUCE_CALLS = 5


def compressor_kwargs(name: str) -> dict[str, Any]:
    """The SparseLoCo every fragment of config ``name`` uses."""
    cfg = CONFIGS[name]
    if "instance" in cfg:
        return dict(cfg["instance"])
    kw = cfg["kw"]
    return dict(density=kw["density"], bits=kw["bits"], chunk=PAPER_CHUNK, decay=kw["outer_momentum"])


def build(name: str, params, group) -> DiLoCo:
    cfg = CONFIGS[name]
    kw = dict(cfg["kw"])
    if "instance" in cfg:
        kw["compressor"] = SparseLoCo(**cfg["instance"])
    return DiLoCo(make_inner(cfg.get("inner", "sgd"), params), **kw, process_group=group)


def reduce_inputs(call: int, rank: int, dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * call + rank)
    return [(torch.randn(s, generator=gen, dtype=torch.float64) * (1 + rank)).to(dtype) for s in REDUCE_SHAPES]


def _reduce(name: str, group) -> dict[str, Any]:
    kwargs, dtype, average = REDUCE[name]
    compressor = SparseLoCo(**kwargs)
    residuals = [torch.zeros(s, dtype=dtype) for s in REDUCE_SHAPES]
    outs, sent = [], []
    for call in range(1, REDUCE_CALLS + 1):
        before = comm_stats().copy()
        stats = CommStats()
        out = compressor.reduce(reduce_inputs(call, dist.get_rank(), dtype), residuals, group=group, average=average,
                                stats=stats)
        outs.append([o.clone() for o in out])
        sent.append({"stats": stats.bytes_sent, "agreement": (comm_stats() - before).bytes_sent})
    world = dist.get_world_size(group)
    return {"outs": outs, "residuals": [e.clone() for e in residuals], "sent": sent,
            "predicted": compressor.bytes_sent([torch.Size(s).numel() for s in REDUCE_SHAPES], world, dtype)}


def _run(name: str, rank: int, group) -> dict[str, Any]:
    cfg = CONFIGS[name]
    params = [p.requires_grad_() for p in init_params()]
    opt = build(name, params, group)
    per_step: list[dict] = []
    with counting_collectives() as counter:
        history = _steps(opt, params, rank, range(1, STEPS + 1), per_step, counter)
    resumed, saved = resumed_run(build, name, group, rank, cfg["split"], STEPS)  # a checkpoint after step split
    out = {"history": history, "resumed": resumed, "per_step": per_step, "bounds": opt.bounds,
           "syncs": [syncing_fragment(t, opt.sync_every, opt.fragments) for t in range(1, STEPS + 1)],
           "predicted": [c.bytes_sent([p.numel() for p in params[lo:hi]], dist.get_world_size(group))
                         for c, (lo, hi) in zip(opt.compressors, opt.bounds)],
           "saved_pending": saved["opt"]["diloco"]["pending"] is not None,
           "saved_residuals": [e is not None for e in saved["opt"]["diloco"]["residuals"]],
           "outer_momenta": len(opt.outer_momenta),
           "residuals": [None if e is None else e.clone() for e in opt.residuals]}
    if cfg["finish"] is not None:  # a run that ends between syncs: finish() synchronises what is apart
        ended = [p.requires_grad_() for p in init_params()]
        opt3 = build(name, ended, group)
        _steps(opt3, ended, rank, range(1, cfg["finish"] + 1))
        out["finished"] = {"synced": opt3.finish(), "params": [p.detach().clone() for p in ended]}
    return out


def suite(rank: int, world: int) -> dict[str, Any]:
    set_collective_timeout(30)
    pair = dist.new_group([0, 1])
    out: dict[str, Any] = {"reduce": {2: {}, 3: {}}, "runs": {}}
    for name in REDUCE:
        if rank < 2:
            out["reduce"][2][name] = _reduce(name, pair)
        out["reduce"][3][name] = _reduce(name, None)
    for name, cfg in CONFIGS.items():
        if cfg["world"] == 3:
            out["runs"][name] = _run(name, rank, None)
        elif rank < 2:
            out["runs"][name] = _run(name, rank, pair)
    params = [p.requires_grad_() for p in init_params()]
    inner = torch.optim.SGD(params, lr=0.1)
    out["density_differs"] = error_text(lambda: DiLoCo(inner, sync_every=3, compressor="sparseloco",
                                                       density=0.5 if rank == 1 else 0.25))
    out["bits_differs"] = error_text(lambda: DiLoCo(inner, sync_every=3, compressor="sparseloco", bits=2 + rank))
    out["refused_on_one"] = error_text(lambda: DiLoCo(inner, sync_every=3, compressor="sparseloco",
                                                      bits=9 if rank == 2 else 2))
    return out
