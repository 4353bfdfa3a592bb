"""Reference: mlbench-core's centralized (synchronous) optimizers, W workers simulated in one
process. Written from mlbench's documented semantics (mlbench_core/optim/pytorch/
centralized.py and aggregation/pytorch/centralized.py, read for the details), plain loops.

Each worker w holds its own copy of the params and its own local optimizer (a reference with
``step(grads)`` and ``lr``, e.g. RefSGD below, RefAdam, or TorchLocal around a torch.optim class).
Per step, with the workers' gradients g_w (None = that worker has none for that param) and the
divisor D (W for "world", the step's denom for "custom", none for "sum"):

    agg_grad=True:
        a_i = sum_w g_w,i / D        (divide_before: sum_w (g_w,i / D); a worker without g_w,i adds 0;
                                      a_i = None when no worker has one)
        clip (grad_clip = c < inf, torch's clip_grad_norm_ on the aggregate):
            N = sqrt(sum_i ||a_i||^2),  a_i <- a_i * min(1, c / (N + 1e-6))
        every worker: local step with a (so all workers stay equal)
    agg_grad=False (mlbench also averages the weights once at construction):
        every worker: local step with its own g_w;  then p_i <- sum_w p_w,i / W  on every worker

``by_layer`` changes only how the real optimizers communicate, never these equations. The math runs
in the params' dtype (float64 in the tests).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from ._common import as_param_list, check_grads, torch_momentum, with_grads

AVERAGES = ("world", "custom", "sum")


class RefSGD:
    """torch.optim.SGD's equations: d = g + wd p; b <- d (first step) else mu b + (1 - tau) d;
    d <- d + mu b (nesterov) or b; p <- p - lr d. None grads are skipped."""

    def __init__(self, params, lr: float, momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
                 nesterov: bool = False):
        self.params = as_param_list(params)
        self.lr, self.momentum, self.dampening = lr, momentum, dampening
        self.weight_decay, self.nesterov = weight_decay, nesterov
        self.state: dict[int, dict] = {}

    @torch.no_grad()
    def step(self, grads) -> None:
        for i, p, g in with_grads(self.params, check_grads(self.params, grads)):
            d = g + self.weight_decay * p
            if self.momentum != 0:
                buf = torch_momentum(self.state, i, d, self.momentum, self.dampening)
                d = d + self.momentum * buf if self.nesterov else buf
            p.sub_(self.lr * d)


class TorchLocal:
    """A torch.optim optimizer as a reference local step (for CustomCentralizedOptimizer's "any optimizer")."""

    def __init__(self, params, opt_cls, **kwargs):
        self.params = as_param_list(params)
        self.opt = opt_cls(self.params, **kwargs)

    @property
    def lr(self) -> float:
        return self.opt.param_groups[0]["lr"]

    @lr.setter
    def lr(self, value: float) -> None:
        for group in self.opt.param_groups:
            group["lr"] = value

    @torch.no_grad()
    def step(self, grads) -> None:
        for p, g in zip(self.params, check_grads(self.params, grads)):
            p.grad = None if g is None else g.clone()
        self.opt.step()


def _divide(x: torch.Tensor, divisor: float | None) -> torch.Tensor:
    return x if divisor is None else x / divisor


class RefCentralized:
    """W workers of a centralized optimizer; ``workers[w]`` are worker w's params (updated in place)."""

    def __init__(self, params: Sequence[torch.Tensor], world_size: int, make_local: Callable[[list], object], *,
                 agg_grad: bool = True, divide_before: bool = False, average: str = "world",
                 grad_clip: float = math.inf, worker_params: Sequence[Sequence[torch.Tensor]] | None = None):
        if average not in AVERAGES:
            raise ValueError(f"average must be one of {AVERAGES}, got {average!r}")
        self.world_size = world_size
        self.agg_grad, self.divide_before, self.average, self.grad_clip = agg_grad, divide_before, average, grad_clip
        starts = worker_params if worker_params is not None else [params] * world_size
        self.workers = [[p.clone() for p in start] for start in starts]
        if not agg_grad:  # mlbench aggregates the params once at construction
            self._average_weights()
        self.locals = [make_local(ps) for ps in self.workers]

    @property
    def lr(self) -> float:
        return self.locals[0].lr

    @lr.setter
    def lr(self, value: float) -> None:
        for local in self.locals:
            local.lr = value

    def _divisor(self, denom: float | None) -> float | None:
        if self.average == "world":
            return float(self.world_size)
        if self.average == "custom":
            if denom is None:
                raise ValueError("average='custom' needs a denom")
            return float(denom)
        return None

    def _sum(self, tensors: list[torch.Tensor | None], divisor: float | None) -> torch.Tensor | None:
        present = [t for t in tensors if t is not None]
        if not present:
            return None
        total = torch.zeros_like(present[0])
        for t in present:
            total = total + (_divide(t, divisor) if self.divide_before else t)
        return total if self.divide_before else _divide(total, divisor)

    def _average_weights(self) -> None:
        for i in range(len(self.workers[0])):
            mean = self._sum([ps[i] for ps in self.workers], float(self.world_size))
            for ps in self.workers:
                ps[i].copy_(mean)

    def aggregate(self, grads_per_worker: Sequence[Sequence[torch.Tensor | None]],
                  denom: float | None = None) -> list[torch.Tensor | None]:
        """The aggregated (and clipped) gradients every worker steps with (agg_grad=True)."""
        divisor = self._divisor(denom)
        agg = [self._sum([grads[i] for grads in grads_per_worker], divisor)
               for i in range(len(grads_per_worker[0]))]
        if self.grad_clip != math.inf:
            norm = math.sqrt(sum(float((a * a).sum()) for a in agg if a is not None))
            coef = min(1.0, self.grad_clip / (norm + 1e-6))
            agg = [None if a is None else a * coef for a in agg]
        return agg

    @torch.no_grad()
    def step(self, grads_per_worker: Sequence[Sequence[torch.Tensor | None]], denom: float | None = None) -> None:
        if len(grads_per_worker) != self.world_size:
            raise ValueError(f"expected gradients of {self.world_size} workers, got {len(grads_per_worker)}")
        if self.agg_grad:
            agg = self.aggregate(grads_per_worker, denom)
            for local in self.locals:
                local.step([None if a is None else a.clone() for a in agg])
        else:
            for local, grads in zip(self.locals, grads_per_worker):
                local.step(grads)
            self._average_weights()
