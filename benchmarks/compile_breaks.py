"""torch.compile graph breaks of a training step with our optimizers.

    python benchmarks/compile_breaks.py                      # AdamW, SGD, Lion: graph breaks
    python benchmarks/compile_breaks.py --optimizers adamw
    python benchmarks/compile_breaks.py --eager-step         # + AdamW's eager step time, 2000 tensors

For each optimizer, ``torch._dynamo.explain`` of ``step_fn`` (forward, backward, ``optimizer.step()``,
``zero_grad``) on a small MLP on the CPU, twice: on the very first step (the optimizer creates its
states while being traced) and on a later step (states exist: what every further step compiles).
Prints explain's graph and break counts, then every break from dynamo's graph_breaks log (explain's
own reason list misses breaks inside inlined calls) with its location; a break is ours when its
location or user stack lies in the lightning_optim package.

``--eager-step`` times ``optimizer.step()`` of AdamW over 2000 fp32 tensors of 5000 elements
(10M params) without torch.compile: the kernels' eager call path (median of the repeats).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import lightning_optim
from lightning_optim import ops
from lightning_optim.ops.graph_breaks import PACKAGE_DIR, explain_breaks

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import save  # noqa: E402

OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "adamw": lambda params: lightning_optim.AdamW(params, lr=1e-3),
    "sgd": lambda params: lightning_optim.SGD(params, lr=1e-2, momentum=0.9),
    "lion": lambda params: lightning_optim.Lion(params, lr=1e-4),
}


def shown(where: str) -> str:
    return where.replace(str(Path(PACKAGE_DIR).parent) + "/", "")


def make_step(name: str) -> tuple[Callable[[], None], torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    opt = OPTIMIZERS[name](list(model.parameters()))
    x, y = torch.randn(16, 32), torch.randn(16, 8)

    def step_fn() -> None:
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()

    return step_fn, opt


def report(name: str, phase: str, step_fn: Callable[[], None]) -> dict:
    out, breaks = explain_breaks(step_fn)
    ours = [b for b in breaks if b.in_lightning_optim]
    print(f"{name:6s} {phase:11s} explain: graphs {out.graph_count}, breaks {out.graph_break_count}; "
          f"dynamo's log: {len(breaks)} breaks, {len(ours)} in lightning_optim")
    for b in breaks:
        print(f"    [{'ours ' if b.in_lightning_optim else 'other'}] {shown(b.where)}: {b.reason[:120]}")
    return {"optimizer": name, "phase": phase, "graphs": out.graph_count, "breaks": len(breaks), "ours": len(ours),
            "reasons": [f"{'ours' if b.in_lightning_optim else 'other'}: {shown(b.where)}: {b.reason[:120]}"
                        for b in breaks]}


def eager_step_time(repeat: int) -> float:
    torch.manual_seed(0)
    params = [torch.randn(5000, requires_grad=True) for _ in range(2000)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = lightning_optim.AdamW(params, lr=1e-3)
    for _ in range(3):
        opt.step()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--optimizers", nargs="*", choices=sorted(OPTIMIZERS), default=["adamw", "sgd", "lion"])
    parser.add_argument("--eager-step", action="store_true", help="also time AdamW's eager step (2000 tensors)")
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs, torch {torch.__version__}, "
          f"Python {platform.python_version()}, backend {ops.backend_for('cpu')}, load {os.getloadavg()[0]:.2f}")
    rows = []
    for name in args.optimizers:
        step_fn, _ = make_step(name)
        rows.append(report(name, "first step", step_fn))
        step_fn, _ = make_step(name)
        step_fn()  # eager: the states exist from here on
        rows.append(report(name, "later step", step_fn))
    found = {"backend": ops.backend_for("cpu"), "rows": rows}
    if args.eager_step:
        took = eager_step_time(args.repeat)
        print(f"AdamW eager step, 2000 x 5000 fp32: {took * 1e3:.2f} ms (median of {args.repeat})")
        found["eager_adamw_ms"] = took * 1e3
    save("compile_breaks", found)


if __name__ == "__main__":
    main()
