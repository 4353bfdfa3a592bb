"""One replica group of a fault-tolerant DiLoCo run, launched as users launch one (``python replica.py ...``).

It trains a small regression model on its own stream of samples with ``DiLoCo(..., manager=replica_manager(...))``
and appends one JSON line per inner step to ``--events``: the inner step ``t``, the manager's committed step
``s``, a checksum of the global params, rounds discarded, the training loss and the time. The last line holds the
evaluation loss after ``finish()``. ``--die-in-exchange S`` makes it SIGKILL itself inside the exchange of the round
after its committed step ``S``, after its own all-reduce was issued (the survivors are mid-exchange).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
import zlib
from pathlib import Path

import torch

from lightning_optim import fault_tolerance
from lightning_optim.distributed.diloco import DiLoCo

FEATURES = 16


def teacher() -> torch.Tensor:
    return torch.randn(FEATURES, generator=torch.Generator().manual_seed(7))


def batch(seed: int, size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(size, FEATURES, generator=g)
    return x, x @ teacher() + 0.1 * torch.randn(size, generator=g)


def model() -> torch.nn.Module:
    torch.manual_seed(0)  # every replica starts alike; a returning one takes its peers' params anyway
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Linear(16, 1))


def loss_of(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((net(x).squeeze(-1) - y) ** 2).mean()


def checksum(tensors) -> int:
    crc = 0
    for t in tensors:
        crc = zlib.crc32(t.detach().contiguous().numpy().tobytes(), crc)
    return crc


class DiesInExchange(DiLoCo):
    """DiLoCo whose process dies inside one exchange (fault injection for the tests)."""

    die_after_step = -1

    def _exchange(self, fragment, t, final, group, zero=False):
        exchange = super()._exchange(fragment, t, final, group, zero=zero)  # this replica's all-reduce is in flight
        if self.replicas.manager.current_step() == self.die_after_step:
            os.kill(os.getpid(), signal.SIGKILL)
        return exchange


def main() -> None:
    logging.basicConfig(level=logging.WARNING)  # torchft's errors into this replica's log
    parser = argparse.ArgumentParser()
    parser.add_argument("--replica", required=True)
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--events", required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--sync-every", type=int, default=5)
    parser.add_argument("--fragments", type=int, default=1)
    parser.add_argument("--overlap", action="store_true")
    parser.add_argument("--compressor", default=None)
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.9)
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--step-sleep", type=float, default=0.05)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--host", default="localhost")
    parser.add_argument("--die-in-exchange", type=int, default=-1)
    parser.add_argument("--start-with", type=int, default=0, help="wait for this many replicas' processes first")
    parser.add_argument("--start-dir", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    index = int(args.replica.lstrip("r"))
    net = model()
    manager = fault_tolerance.replica_manager(replica_id=args.replica, min_replica_size=args.min_replicas,
                                              lighthouse=args.lighthouse, host=args.host, timeout_s=args.timeout)
    if args.start_with:  # the job starts all replicas at once, as a scheduler would
        start_dir = Path(args.start_dir)
        (start_dir / args.replica).touch()
        deadline = time.monotonic() + 120
        while len(list(start_dir.iterdir())) < args.start_with:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{args.start_with} replicas did not start within 120 s")
            time.sleep(0.02)
    DiesInExchange.die_after_step = args.die_in_exchange
    opt = DiesInExchange(torch.optim.SGD(net.parameters(), lr=0.05), sync_every=args.sync_every,
                         outer_lr=args.outer_lr, outer_momentum=args.outer_momentum,
                         nesterov=args.outer_momentum > 0, fragments=args.fragments, overlap=args.overlap,
                         compressor=args.compressor, manager=manager)
    with open(args.events, "a") as events:
        def record(**extra) -> None:
            events.write(json.dumps({"t": opt.inner_steps, "s": manager.current_step(), "pid": os.getpid(),
                                     "crc": checksum(opt.global_params), "discarded": opt.replicas.rounds_discarded,
                                     "participants": manager.num_participants(), "time": time.time(), **extra}) + "\n")
            events.flush()

        record(joined=True)
        while opt.inner_steps < args.steps:
            x, y = batch(1_000_003 * index + opt.inner_steps)
            loss = loss_of(net, x, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            record(loss=float(loss))
            time.sleep(args.step_sleep)
        opt.finish()
        with torch.no_grad():
            x, y = batch(999, size=2048)
            record(done=True, eval=float(loss_of(net, x, y)), params=checksum(net.parameters()))
    manager.shutdown(wait=False)
    sys.exit(0)


if __name__ == "__main__":
    main()
