"""One rank of gpu_check.sh's 2-rank run over gloo: the compressed allreduce and a short OnebitAdam loop on
``--device`` tensors (cuda: both ranks share the one GPU). Run under torchrun; each rank saves what it
computed to ``<out>.rank<r>.pt``, and gpu_check_report.py compares the cuda run with the cpu run.

    torchrun --nproc-per-node 2 benchmarks/gpu_check_ranks.py --device cuda --out /tmp/ranks_cuda

The inputs are made on the CPU from fixed seeds, so both runs see the same numbers. The loop's gradients
are given coefficients (loss = sum(p * c)): no matmul enters, the only differences between the runs are
the optimizer and compression kernels'.
"""

from __future__ import annotations

import argparse
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_optim.comm import compressed_allreduce, make_error_buffers
from lightning_optim.onebit import OnebitAdam

SEGMENTS = [13, 0, 70_000, 5, 1, 8192 * 3 + 7, 100_003]  # empty, tiny, odd, across kernel block ranges
SHAPES = [(256, 129), (129,), (1000, 37), (7,), (64, 64, 3)]
ALLREDUCE_ROUNDS = 4
STEPS, FREEZE_STEP = 12, 4


def allreduce(rank: int, device: torch.device) -> list[torch.Tensor]:
    n = sum(SEGMENTS)
    x = torch.zeros(n, device=device)
    worker, server = make_error_buffers(x, segments=SEGMENTS)
    outs = []
    for r in range(ALLREDUCE_ROUNDS):  # rounds carry the error buffers over
        x.copy_(torch.randn(n, generator=torch.Generator().manual_seed(100 * r + rank)))
        compressed_allreduce(x, worker, server, segments=SEGMENTS)
        outs.append(x.cpu().clone())
    outs += [worker.cpu(), server.cpu()]
    return outs


def train(rank: int, device: torch.device) -> dict:
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen).to(device).requires_grad_() for s in SHAPES]
    opt = OnebitAdam(params, lr=1e-2, freeze_step=FREEZE_STEP, weight_decay=0.01)
    history = []
    for step in range(STEPS):
        coeffs = torch.Generator().manual_seed(1000 * step + rank)
        loss = sum((p * torch.randn(p.shape, generator=coeffs).to(device)).sum() for p in params)
        loss.backward()
        opt.step()
        opt.zero_grad()
        history.append([p.detach().cpu().clone() for p in params])
    return {"history": history}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=["cpu", "cuda"], required=True)
    parser.add_argument("--out", required=True, help="path prefix; each rank writes <out>.rank<r>.pt")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=90))  # a rank that failed must not hang the other for 30 min
    rank = dist.get_rank()
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    started = time.perf_counter()
    result = {"device": args.device, "world": dist.get_world_size(), "errors": {}}
    for name, fn in (("allreduce", allreduce), ("train", train)):
        try:  # one part failing (e.g. gloo refusing a CUDA collective) still leaves the other's result
            result[name] = fn(rank, device)
        except Exception as exc:  # noqa: BLE001 - reported, not hidden: the report lists it as a failure
            result["errors"][name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    result["seconds"] = time.perf_counter() - started
    torch.save(result, f"{args.out}.rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
