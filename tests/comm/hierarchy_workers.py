"""Rank-side code of test_hierarchy.py: 4 gloo ranks taken as 2 nodes of 2 (and other node sizes)."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from lightning_optim.comm import CommStats, compressed_allreduce, make_error_buffers
from lightning_optim.comm.compressors.hierarchical import HierarchicalOnebitCompressor
from tests.comm.workers import make_inputs, segment_scales
from tests.onebit.workers import CONFIGS, build, init_params, rank_grads
from tests.ranks import ignore_warnings, record_warnings
from tests.wire import wire_bytes_sent

CALLS = 8
LENGTHS = [3, 1001, 4099]  # below L, odd (the last shard padded), large
SEGMENTS = [33, 64, 2, 0, 2050]  # one scale each; several straddle the shard edge (S = 1075)


def _calls(compressor, rank, inputs, segments=None):
    outs, stats = [], CommStats()
    for call in range(len(inputs)):
        t = inputs[call][rank].clone()
        compressor.reduce_flat_(t, segments=segments, stats=stats)
        outs.append(t)
    return {"outs": outs, "worker_error": compressor.worker_error.clone(),
            "server_error": compressor.server_error.clone(), "stats": stats.as_dict()}


def _outcome(fn):
    try:
        fn()
        return "no error"
    except ValueError as exc:
        return str(exc)


def compressor_suite(rank, world):
    out = {}
    for numel in LENGTHS:
        out[numel] = _calls(HierarchicalOnebitCompressor(2), rank, make_inputs(world, numel, torch.float32)[:CALLS])
    numel = sum(SEGMENTS)
    scaled = [[x * segment_scales(SEGMENTS) for x in row] for row in make_inputs(world, numel, torch.float32)[:CALLS]]
    out["segmented"] = _calls(HierarchicalOnebitCompressor(2), rank, scaled, SEGMENTS)
    # hierarchical=True reads torchrun's LOCAL_WORLD_SIZE
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    out["from_env"] = _calls(HierarchicalOnebitCompressor(True), rank, scaled, SEGMENTS)["outs"]
    # one node of 4: the exact mean, nothing compressed; nodes of 1: the flat 1-bit allreduce
    inputs = make_inputs(world, 1001, torch.float32)[:3]
    one_node = HierarchicalOnebitCompressor(4)
    stats, outs = CommStats(), []
    with record_warnings() as caught:
        for call in range(3):
            t = inputs[call][rank].clone()
            one_node.reduce_flat_(t, stats=stats)
            outs.append(t)
    out["one_node"] = {"outs": outs, "stats": stats.as_dict(), "errors": one_node.worker_error,
                       "warnings": [str(w.message) for w in caught]}
    flat_errors = make_error_buffers(inputs[0][rank])
    singles = HierarchicalOnebitCompressor(1)
    pairs = []
    for call in range(3):
        a, b = inputs[call][rank].clone(), inputs[call][rank].clone()
        singles.reduce_flat_(a)
        compressed_allreduce(b, *flat_errors)
        pairs.append((a, b))
    out["nodes_of_one"] = pairs
    # the warmup's fp32 hierarchical mean
    means = []
    for call in range(3):
        t = inputs[call][rank].clone()
        HierarchicalOnebitCompressor(2).average_flat_(t)
        means.append(t)
    out["average"] = means
    # refused on every rank: a node size that does not divide the world, uneven nodes
    out["three"] = _outcome(lambda: HierarchicalOnebitCompressor(3).reduce_flat_(torch.ones(10)))
    os.environ["LOCAL_WORLD_SIZE"] = "2" if rank < 2 else "1"
    out["uneven"] = _outcome(lambda: HierarchicalOnebitCompressor(True).reduce_flat_(torch.ones(10)))
    after = torch.full((10,), float(rank))
    HierarchicalOnebitCompressor(2).average_flat_(after)
    out["after"] = after
    return out


def optimizer_suite(rank, world, name):
    """``name``'s optimizer with hierarchical=2 for its whole run; params after each step, its state dict."""
    _, _, steps = CONFIGS[name]
    params = init_params()
    opt = build(name, params, hierarchical=2)
    history = []
    for step in range(1, steps + 1):
        for p, g in zip(params, rank_grads(step, rank)):
            p.grad = g
        opt.step()
        history.append([p.detach().clone() for p in params])
    return {"params": history, "errors": (opt.compressor.worker_error.clone(), opt.compressor.server_error.clone()),
            "onebit_state": opt.state_dict()["onebit"]}


WIRE_NUMEL = 200_003  # odd: the last shard padded; large enough that a miscounted shard is 400 KB off


def _on_the_wire(call) -> tuple[int, int | None]:
    """(bytes counted in the CommStats ``call`` fills, bytes this process's gloo sockets sent meanwhile), between
    barriers (whose few bytes land in the wire figure); the wire figure is None without ``ss``."""
    stats = CommStats()
    dist.barrier()
    before = wire_bytes_sent()
    call(stats)
    dist.barrier()
    after = wire_bytes_sent()
    return stats.bytes_sent, None if before is None or after is None else after - before


def wire_suite(rank, world):
    """Counted vs sent, per call, after a first call (which makes the node groups and agrees on the layout):
    the fp32 hierarchical mean and the 1-bit exchange as 2 nodes of 2, one node of 4, and a plain all-reduce."""
    x = torch.randn(WIRE_NUMEL, generator=torch.Generator().manual_seed(rank))
    out = {}
    cases = {"hier_fp32": (HierarchicalOnebitCompressor(2), "average_flat_"),
             "hier_1bit": (HierarchicalOnebitCompressor(2), "reduce_flat_"),
             "one_node_fp32": (HierarchicalOnebitCompressor(4), "average_flat_")}
    with ignore_warnings():  # the one-node warning: test_hierarchy checks it elsewhere
        for name, (compressor, method) in cases.items():
            average = getattr(compressor, method)
            average(x.clone())  # groups, agreements, error buffers
            out[name] = _on_the_wire(lambda stats, average=average: average(x.clone(), stats=stats))
    out["flat_all_reduce"] = _on_the_wire(lambda stats: dist.all_reduce(x.clone()))
    return out
