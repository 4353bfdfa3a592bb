"""Rank side of test_shared_base: the 1-bit compressor's reduce against compressed_allreduce called by hand."""

from __future__ import annotations

import torch

from lightning_optim.comm import comm_stats, compressed_allreduce, make_error_buffers
from lightning_optim.comm.compressors.onebit import OnebitCompressor


def onebit_reduce(rank: int, world: int) -> dict:
    gen = torch.Generator().manual_seed(10 + rank)
    shapes = [(7, 5), (13,), (3, 2, 2)]
    compressor = OnebitCompressor()
    flat_ref = None
    out = {"ours": [], "by_hand": [], "bytes": [], "predicted": []}
    worker = server = None
    for step in range(4):
        tensors = [torch.randn(s, generator=gen) for s in shapes]
        before = comm_stats().bytes_sent
        reduced = compressor.reduce(tensors)
        out["bytes"].append(comm_stats().bytes_sent - before)
        out["predicted"].append(compressor.bytes_sent([t.numel() for t in tensors], world))
        flat_ref = torch.cat([t.reshape(-1) for t in tensors])
        segments = [t.numel() for t in tensors]
        if worker is None:
            worker, server = make_error_buffers(flat_ref, None, segments)
        compressed_allreduce(flat_ref, worker, server, segments=segments)
        out["ours"].append(torch.cat([r.reshape(-1) for r in reduced]))
        out["by_hand"].append(flat_ref.clone())
    state = compressor.state_dict()
    out["errors_equal"] = torch.equal(state["worker_error"], worker) and torch.equal(state["server_error"], server)
    out["origin"] = (state["world_size"], state["rank"])
    return out
