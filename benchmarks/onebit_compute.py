"""OnebitAdam's compression-stage step vs AdamW's step on the same params, compute only.

Two gloo ranks on loopback, one torch thread each, the same params on both (a GPT-2-like layout of
``--layers`` blocks at width ``--width``: ~100 tensors). Per round each rank takes one
``lightning_optim.AdamW`` step and one ``OnebitAdam`` compression-stage step (after ``freeze_step``);
the time inside the collectives (every ``collective(...)`` call of ``lightning_optim.comm``, the wait
for the other rank included) is measured and taken off the 1-bit step: "compute" is what is left.
Medians over ``--steps`` rounds of the slower rank.

    python benchmarks/onebit_compute.py                  # width 512, 8 layers (~25M params)
    python benchmarks/onebit_compute.py --width 256 --layers 6
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from comm import _free_port, machine_facts  # noqa: E402
from results import save  # noqa: E402


def shapes(width: int, layers: int) -> list[tuple[int, ...]]:
    block = [(3 * width, width), (3 * width,), (width, width), (width,), (4 * width, width), (4 * width,),
             (width, 4 * width), (width,), (width,), (width,), (width,), (width,)]
    return [(256, width), (1024, width)] + block * layers + [(width,), (width,)]


class CollectiveClock:
    """Adds up the seconds spent inside ``collective`` of lightning_optim.comm (launch + wait)."""

    def __init__(self) -> None:
        import lightning_optim.comm.compressed as compressed
        import lightning_optim.comm.dense as dense
        import lightning_optim.comm.timeouts as timeouts

        self.seconds = 0.0
        inner = timeouts.collective

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        for module in (compressed, dense, timeouts):
            module.collective = timed


def make_params(sizes, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen).mul_(0.02).requires_grad_() for s in sizes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    return params


def slowest(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def worker(rank: int, world: int, port: int, args, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import lightning_optim as lo
    from lightning_optim import ops

    sizes = shapes(args.width, args.layers)
    adamw_params, onebit_params = make_params(sizes, 0), make_params(sizes, 0)
    adamw = lo.AdamW(adamw_params, lr=1e-4, weight_decay=0.1)
    onebit = lo.OnebitAdam(onebit_params, lr=1e-4, weight_decay=0.1, freeze_step=2)
    for _ in range(2):  # warmup stage: Adam on averaged grads
        onebit.step()
    assert onebit.in_compression_stage
    clock = CollectiveClock()
    rows = []
    for i in range(args.steps + args.skip):
        dist.barrier()
        start = time.perf_counter()
        adamw.step()
        t_adamw = time.perf_counter() - start
        dist.barrier()
        before = clock.seconds
        start = time.perf_counter()
        onebit.step()
        t_onebit = time.perf_counter() - start
        t_comm = clock.seconds - before
        if i >= args.skip:
            rows.append(slowest([t_adamw, t_onebit, t_onebit - t_comm, t_comm]))
    if rank == 0:
        med = [statistics.median(col) for col in zip(*rows)]
        out.put({"numel": sum(p.numel() for p in adamw_params), "tensors": len(sizes), "medians": med,
                 "backend": ops.backend_for("cpu")})
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--skip", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    print(machine_facts())
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=worker, args=(r, 2, port, args, out)) for r in range(2)]
    for p in procs:
        p.start()
    result = out.get(timeout=1200)
    for p in procs:
        p.join()
    adamw, onebit, compute, comm = result["medians"]
    print(f"2 gloo ranks, loopback, {args.threads} thread(s) each; {result['numel'] / 1e6:.1f}M params in "
          f"{result['tensors']} tensors; kernels: {result['backend']}; medians of {args.steps} rounds, slower rank")
    print(f"  lightning_optim.AdamW step                {1e3 * adamw:8.2f} ms   ref")
    print(f"  OnebitAdam compression step               {1e3 * onebit:8.2f} ms   {onebit / adamw:5.2f}x")
    print(f"    of which inside collectives            {1e3 * comm:8.2f} ms")
    print(f"    compute (step - collectives)            {1e3 * compute:8.2f} ms   {compute / adamw:5.2f}x"
          "   (goal <= 1.2x)")
    save("onebit_compute", {"numel": result["numel"], "tensors": result["tensors"], "backend": result["backend"],
                            "steps": args.steps, "skip": args.skip, "threads": args.threads, "adamw_ms": 1e3 * adamw,
                            "onebit_ms": 1e3 * onebit, "in_collectives_ms": 1e3 * comm, "compute_ms": 1e3 * compute})


if __name__ == "__main__":
    main()
