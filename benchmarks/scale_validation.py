"""Measurements behind ``benchmarks/scale_model.py``: the 1-bit compute rate and shaped-link timings.

* ``onebit_compute_rate``: seconds per element of ``compressed_allreduce``'s own compute (worker
  norms + compress, server average + compress, unpack), in this process, 1 thread, with the
  collectives skipped (a ``fake`` process group gives the world size; nothing is sent).
* ``measure``: ``W`` gloo ranks in network namespaces on a bridge (``netns_bridge.py``), each
  veth shaped to ``rate``; per tensor size, the slowest rank's median time of ``allreduce_mean``
  (fp32) and of ``compressed_allreduce`` (one segment).
  The time ``compressed_allreduce`` spends inside its collectives is taken too (slowest rank):
  the communication part the alpha-beta model predicts, plus any wait for a slower rank.
* ``fit_link``: alpha and beta from the 2-rank fp32 times at two sizes (``T = 2 alpha + 4 n beta``).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from netns_bridge import netns_bridge, rank_address  # noqa: E402
from scale_formulas import Link, ring_allreduce_bytes  # noqa: E402

PORT = 29561


# docs/benchmarks.md ("Compressed allreduce"): one thread streams ~37 GB/s here, both cores together
# 41-52 GB/s; W ranks computing at once on this 2-core VM share that, each slowed by this factor
SINGLE_THREAD_GBPS, MACHINE_GBPS = 37.0, 46.0


def memory_share_slowdown(ranks: int) -> float:
    """How much slower a memory-bound pass runs when ``ranks`` single-thread ranks stream at once here."""
    return max(1.0, ranks * SINGLE_THREAD_GBPS / MACHINE_GBPS)


def onebit_compute_rate(numel: int, world: int = 2, repeats: int = 5) -> float:
    """Median seconds per element of one ``compressed_allreduce``'s compute (collectives skipped)."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import lightning_optim.comm.compressed as compressed_mod

    torch.set_num_threads(1)
    saved = compressed_mod.collective, compressed_mod._agree
    compressed_mod.collective = lambda name, fn, *args, **kwargs: None
    compressed_mod._agree = lambda *args, **kwargs: None
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        x = torch.randn(numel)
        worker_error, server_error = compressed_mod.make_error_buffers(x)
        compressed_mod.compressed_allreduce(x, worker_error, server_error)
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            compressed_mod.compressed_allreduce(x, worker_error, server_error)
            samples.append(time.perf_counter() - start)
    finally:
        dist.destroy_process_group()
        compressed_mod.collective, compressed_mod._agree = saved
    return statistics.median(samples) / numel


# ----------------------------------------------------------------------------- rank side
def worker(rank: int, world: int, sizes: list[int], iters: int, warmup: int) -> None:
    import torch
    import torch.distributed as dist

    from lightning_optim.comm import allreduce_mean, compressed_allreduce, make_error_buffers

    import lightning_optim.comm.compressed as compressed_mod

    inner, in_collectives = compressed_mod.collective, [0.0]

    def timed_collective(name, fn, *args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(name, fn, *args, **kwargs)
        finally:
            in_collectives[0] += time.perf_counter() - start

    compressed_mod.collective = timed_collective
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://{rank_address(0)}:{PORT}",
                            timeout=timedelta(seconds=600))

    def slowest(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    results: dict[str, dict[str, float]] = {}
    for numel in sizes:
        dense = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
        onebit = dense.clone()
        worker_error, server_error = make_error_buffers(onebit)
        times: dict[str, list[float]] = {"fp32": [], "onebit": [], "onebit_in_collectives": []}
        for it in range(warmup + iters):
            for name in ("fp32", "onebit"):
                dist.barrier()
                in_collectives[0] = 0.0
                start = time.perf_counter()
                if name == "fp32":
                    allreduce_mean(dense)
                else:
                    compressed_allreduce(onebit, worker_error, server_error)
                elapsed = slowest(time.perf_counter() - start)
                waited = slowest(in_collectives[0]) if name == "onebit" else 0.0
                if it >= warmup:
                    times[name].append(elapsed)
                    if name == "onebit":
                        times["onebit_in_collectives"].append(waited)
        results[str(numel)] = {k: statistics.median(v) for k, v in times.items()}
    if rank == 0:
        print("RESULT " + json.dumps(results), flush=True)
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- parent side
def measure(world: int, sizes: list[int], rate: str, iters: int = 5, warmup: int = 1) -> dict[str, dict[str, float]]:
    """``{numel: {"fp32": s, "onebit": s}}`` on ``world`` shaped namespaces (raises NetnsUnavailable)."""
    with netns_bridge(world, rate) as (prefixes, envs):
        procs = []
        for rank in range(world):
            cmd = [*prefixes[rank], sys.executable, os.path.abspath(__file__), "--worker", str(rank), str(world),
                   ",".join(map(str, sizes)), str(iters), str(warmup)]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=dict(os.environ, **envs[rank])))
        outputs = [p.communicate()[0] for p in procs]
        if any(p.returncode for p in procs):
            raise RuntimeError(f"validation workers failed: exit codes {[p.returncode for p in procs]}")
    for line in outputs[0].splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError("rank 0 printed no result")


def fit_link(two_rank: dict[str, dict[str, float]]) -> Link:
    """alpha, beta from the 2-rank fp32 times at two sizes: ``T = 2 alpha + ring_bytes * beta``."""
    points = sorted((int(n), v["fp32"]) for n, v in two_rank.items())
    (n1, t1), (n2, t2) = points[0], points[-1]
    b1, b2 = ring_allreduce_bytes(n1, 2), ring_allreduce_bytes(n2, 2)
    beta = (t2 - t1) / (b2 - b1)
    alpha = max((t1 - b1 * beta) / 2, 0.0)
    return Link(alpha, 1 / beta)


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--worker":
    sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
    r, w, s, i, wu = sys.argv[2:7]
    worker(int(r), int(w), [int(v) for v in s.split(",")], int(i), int(wu))
