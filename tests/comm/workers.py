"""Worker-side code for the comm tests: runs inside the ranks spawned by ``comm_spawn``."""
from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_optim.comm import (
    CommStats,
    CommunicationError,
    allreduce_mean,
    comm_stats,
    compressed_allreduce,
    make_error_buffers,
    register_switchable_allreduce,
)
from tests.ranks import seeded

CALLS = 20
# lengths: below 8W, multiples of 8W, and remainders that leave whole padded chunks
LENGTHS = {2: [5, 16, 100, 1000, 4099], 3: [1, 23, 24, 1001], 4: [3, 33, 64, 2050]}
DTYPES = [torch.float32, torch.bfloat16]
# per-segment scales: zero-length, tiny and chunk-straddling segments, magnitudes far apart
SEGMENTS = {2: [5, 0, 100, 3, 1000], 3: [1, 23, 24, 7, 300], 4: [33, 64, 2, 2050]}


def timed_outcome(call) -> tuple[str, float]:
    """(the CommunicationError's message, or what else happened; seconds taken) of ``call()``."""
    start = time.monotonic()
    try:
        call()
        return "no error", time.monotonic() - start
    except CommunicationError as exc:
        return str(exc), time.monotonic() - start
    except Exception as exc:  # noqa: BLE001 - reported as a failure by the tests
        return f"wrong type {type(exc).__name__}: {exc}", time.monotonic() - start


def segment_scales(segments: list[int]) -> torch.Tensor:
    """One magnitude per segment (1e-3 .. 10), so that a shared scale would drown the small ones."""
    return torch.cat([torch.full((n,), 10.0 ** (k % 5 - 3)) for k, n in enumerate(segments)])


def make_inputs(world: int, numel: int, dtype: torch.dtype) -> list[list[torch.Tensor]]:
    """inputs[call][rank]: a persistent per-rank mean (what error feedback must not lose) + noise."""
    g = torch.Generator().manual_seed(1000 * world + numel)
    means = [torch.randn(numel, generator=g) * 0.3 for _ in range(world)]
    return [
        [(means[r] + torch.randn(numel, generator=g)).to(dtype) for r in range(world)]
        for _ in range(CALLS)
    ]


def _run_world(rank, world, group):
    results = {}
    for numel in LENGTHS[world]:
        for dtype in DTYPES:
            inputs = make_inputs(world, numel, dtype)
            worker_error, server_error = make_error_buffers(inputs[0][rank], group)
            outs = []
            for call in range(CALLS):
                t = inputs[call][rank].clone()
                stats = CommStats()
                ret = compressed_allreduce(t, worker_error, server_error, group, stats=stats)
                assert ret is t and t.dtype == dtype
                outs.append(t)
            results[(numel, str(dtype))] = {
                "outs": outs,
                "worker_error": worker_error.clone(),
                "server_error": server_error.clone(),
                "stats": stats.as_dict(),
            }
    # one scale per segment
    segments = SEGMENTS[world]
    numel = sum(segments)
    inputs = make_inputs(world, numel, torch.float32)
    worker_error, server_error = make_error_buffers(inputs[0][rank], group, segments)
    outs = []
    for call in range(CALLS):
        t = inputs[call][rank] * segment_scales(segments)
        compressed_allreduce(t, worker_error, server_error, group, segments=segments)
        outs.append(t)
    results["segmented"] = {"outs": outs, "worker_error": worker_error.clone(), "server_error": server_error.clone()}
    # a 2-D, non-contiguous input goes through the same path as its contiguous copy
    view = (torch.arange(60, dtype=torch.float32).view(6, 10) - 30 + rank).t()
    expect = view.clone()
    compressed_allreduce(expect, *make_error_buffers(view, group), group)
    compressed_allreduce(view, *make_error_buffers(view, group), group)
    results["transposed"] = (view.clone(), expect)
    # ranks disagreeing on numel: ValueError on every rank, and the group is still usable after
    bad = torch.ones(100 + rank)
    try:
        compressed_allreduce(bad, *make_error_buffers(bad, group), group)
        results["mismatch"] = None
    except ValueError as exc:
        results["mismatch"] = str(exc)
    ok = torch.full((10,), float(rank))
    compressed_allreduce(ok, *make_error_buffers(ok, group), group)
    results["after_mismatch"] = ok
    return results


def run_all(rank, world):
    """World sizes 2, 3 and 4 in one spawn of 4 ranks: the smaller ones on sub-groups.

    The DDP hook runs on ranks 0-1 only (DDP's first construction imports ~2 s of torch modules
    per process, which four processes on two cores feel); allreduce_mean on all four.
    """
    groups = {2: dist.new_group([0, 1]), 3: dist.new_group([0, 1, 2]), 4: None}
    results = {"whoami": {"rank": rank, "world": world, "threads": torch.get_num_threads()}}
    for w, group in groups.items():
        if rank < w:
            results[w] = _run_world(rank, w, group)
    if rank < 2:
        results["ddp"] = ddp_hook_checks(rank, groups[2])
    results["mean"] = allreduce_mean_checks(rank, world)
    return results


def _batch(rank: int) -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(100 + rank))


def ddp_hook_checks(rank, group):
    with seeded(0):  # same initial weights on every rank (DDP also broadcasts them)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    local = copy.deepcopy(model)
    local(_batch(rank)).pow(2).sum().backward()
    local_grads = [p.grad.clone() for p in local.parameters()]

    ddp = DDP(model, process_group=group)
    state = register_switchable_allreduce(ddp, group=group)
    before = comm_stats().copy()
    grads = []
    # three on/off phases, enabled twice: DDP rebuilds its buckets after the first iteration
    for enabled in (True, True, False, True):
        state.enabled = enabled
        ddp.zero_grad(set_to_none=True)
        ddp(_batch(rank)).pow(2).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    delta = comm_stats() - before
    numel = sum(p.numel() for p in model.parameters())
    return {
        "local": local_grads,
        "phases": grads,
        "reduced": state.buckets_reduced,
        "skipped": state.buckets_skipped,
        "stats": delta.as_dict(),
        "numel": numel,
    }


def allreduce_mean_checks(rank, world):
    out = {}
    stats = CommStats()
    bf16 = torch.full((7,), rank + 0.5, dtype=torch.bfloat16)
    out["bf16"] = allreduce_mean(bf16, stats=stats)
    fp32 = (torch.arange(12, dtype=torch.float32).view(3, 4) * (rank + 1)).t()  # non-contiguous
    out["fp32"] = allreduce_mean(fp32, stats=stats)
    out["stats"] = stats.as_dict()
    return out
