"""Step time of every lightning-optim optimizer (for-loop and foreach) next to torch's equivalent.

All candidates run in this one process on the same parameter layout, interleaved round by round
so that machine noise hits them alike; the median step time is reported with the ratio
ours / torch (lower is better). Usage:

    python benchmarks/optimizers.py [--params 4000000] [--tensors 200] [--steps 20] [--dtype float32]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import torch

import lightning_optim as lo
from results import save

# (ours, kwargs, torch equivalent or None); the same kwargs go to both.
CASES: list[tuple[str, dict, Callable | None]] = [
    ("Adam", dict(lr=1e-3), torch.optim.Adam),
    ("AdamW", dict(lr=1e-3, weight_decay=0.01), torch.optim.AdamW),
    ("SGD", dict(lr=1e-2, momentum=0.9, nesterov=True), torch.optim.SGD),
    ("RAdam", dict(lr=1e-3), torch.optim.RAdam),
    ("Lamb", dict(lr=1e-3, weight_decay=0.01), None),
    ("Lars", dict(lr=1e-3, momentum=0.9), None),
    ("Lion", dict(lr=1e-4, weight_decay=0.01), None),
    ("Adan", dict(lr=1e-3), None),
    ("Ranger", dict(lr=1e-3), None),
    ("StableAdamW", dict(lr=1e-3, weight_decay=0.01), None),
    ("SignSGD", dict(lr=1e-3, momentum=0.9), None),
]


def make_layout(total: int, tensors: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """``tensors`` tensors holding ``total`` elements, sizes spread over two orders of magnitude."""
    weights = torch.logspace(0, 2, tensors)
    sizes = (weights / weights.sum() * total).long().clamp(min=1)
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(int(n), generator=gen).to(dtype) for n in sizes]


def make_stepper(factory: Callable, base: list[torch.Tensor], **kwargs) -> Callable[[], None]:
    params = [b.clone().requires_grad_() for b in base]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-2
    opt = factory(params, **kwargs)
    opt.step()  # create the states outside the timed region
    return opt.step


def timeit(step: Callable[[], None]) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=4_000_000)
    parser.add_argument("--tensors", type=int, default=200)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    base = make_layout(args.params, args.tensors, dtype)
    print(f"# {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"# {sum(b.numel() for b in base):,} {args.dtype} params in {len(base)} tensors, median of {args.steps} steps")
    print(f"{'optimizer':<12} {'path':<9} {'ms/step':>9} {'torch ms':>9} {'ours/torch':>10}")
    rows = []
    for name, kwargs, torch_cls in CASES:
        if not hasattr(lo, name):
            continue
        ours_cls = getattr(lo, name)
        runs: dict[str, Callable[[], None]] = {}
        for foreach in (False, True):
            path = "foreach" if foreach else "for-loop"
            runs[f"ours/{path}"] = make_stepper(ours_cls, base, foreach=foreach, **kwargs)
            if torch_cls is not None:
                runs[f"torch/{path}"] = make_stepper(torch_cls, base, foreach=foreach, **kwargs)
        if torch_cls is not None and name in ("Adam", "AdamW"):
            runs["torch/fused"] = make_stepper(torch_cls, base, fused=True, **kwargs)
        times: dict[str, list[float]] = {key: [] for key in runs}
        for _ in range(args.steps):
            for key, step in runs.items():
                times[key].append(timeit(step))
        median = {key: statistics.median(t) * 1e3 for key, t in times.items()}
        for path in ("for-loop", "foreach"):
            ours = median[f"ours/{path}"]
            ref = median.get(f"torch/{path}")
            ref_text = f"{ref:9.2f} {ours / ref:10.2f}" if ref else f"{'-':>9} {'-':>10}"
            print(f"{name:<12} {path:<9} {ours:9.2f} {ref_text}")
            rows.append({"optimizer": name, "path": path, "ours_ms": ours, "torch_ms": ref, "torch_path": path})
        if "torch/fused" in median:
            fused = median["torch/fused"]
            print(f"{name:<12} {'vs fused':<9} {median['ours/foreach']:9.2f} {fused:9.2f} {median['ours/foreach'] / fused:10.2f}")
            rows.append({"optimizer": name, "path": "foreach", "ours_ms": median["ours/foreach"], "torch_ms": fused,
                         "torch_path": "fused"})
    save("optimizers", {"params": sum(b.numel() for b in base), "tensors": len(base), "dtype": args.dtype,
                        "steps": args.steps, "kwargs": {name: kwargs for name, kwargs, _ in CASES}, "rows": rows})


if __name__ == "__main__":
    main()
