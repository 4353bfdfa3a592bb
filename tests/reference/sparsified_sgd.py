"""Reference sparsified SGD with error-feedback memory (Stich, Cordonnier & Jaggi 2018,
"Sparsified SGD with Memory", arXiv 1809.07599), matching mlbench-core's ``SparsifiedSGD`` /
``CentralizedSparsifiedSGD`` for one worker (mlbench_core/optim/pytorch/optim.py, checked against
its source).

Per parameter tensor, per step (g = gradient, mem = error memory, init 0; k = sparse_grad_size,
clamped to numel):

    mem <- mem + lr * g                       (mlbench; wd_in_memory=True: mem += lr * (g + wd p))
    S   <- k coordinates chosen by the selection mode (below), over the FLATTENED tensor
    s   <- zeros; s[S] = mem[S];  mem[S] <- 0
    p   <- p - (s + wd * p)                   (mlbench: weight decay applied to p directly and NOT
                                               multiplied by lr; with wd_in_memory=True the wd term
                                               went through the memory instead and p <- p - s)

mlbench only handles parameters of shape [1, d] (it indexes ``memory[0, idx]`` and draws from
``size()[1]``); for such tensors the flattened indexing here is identical, and it generalises to any
shape. mlbench's ``step`` with several workers averages the gathered sparse vectors (``/ world_size``
when ``average_models``); a single worker is this reference.

Selection modes (``mode``; if None, mlbench's ``random_sparse`` flag picks "random"/"blockwise",
mlbench's CentralizedSparsifiedSGD default being blockwise):
  * "random":    k distinct indices uniformly at random (mlbench: ``np.random.choice(d, k,
                 replace=False)``). Here: ``torch.randperm(numel, generator=gen)[:k]``.
  * "blockwise": one of the ``numel // k`` ALIGNED blocks, chosen uniformly (mlbench:
                 ``np.random.randint(0, d // k)``; block b covers [b*k, b*k + k)). Here:
                 ``b = torch.randint(0, numel // k, (1,), generator=gen)``.
  * "topk":      the k entries of largest |mem| (``torch.topk(mem.abs().flatten(), k)``); the
                 paper's top-k compressor, not in mlbench; deterministic.
Randomness contract (so a project optimizer can reproduce the indices exactly): exactly one draw
per parameter that has a grad, per step, in parameter order, from ``generator`` (a CPU
``torch.Generator``; the global RNG when None), using the calls above. Alternatively pass
``index_fn(param_index, flat_memory, k) -> LongTensor`` to inject indices directly (it overrides
``mode``). The indices used at the last step are kept in ``self.last_indices``.

Estimated (weighted-average) weights, mlbench ``update_estimated_weights`` /
``get_estimated_weights``: ``estimated_w`` starts as a copy of the initial params (mlbench also
re-initialises the params with N(0, 0.01) in its constructor; this reference does NOT touch the
params at construction). ``update_estimated_weights(t, sparse_vector_size)``, with
tau = numel / sparse_vector_size (mlbench: size()[1] / sparse_vector_size):
    rho = 6 (t + tau)^2 / ((1 + t) (6 tau^2 + t + 6 tau t + 2 t^2))
    estimated_w <- (1 - rho) estimated_w + rho p
``self.lr`` may be changed between steps. ``None`` grads are skipped (no draw).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ._common import as_param_list, check_grads, with_grads

MODES = ("random", "blockwise", "topk")


class RefSparsifiedSGD:
    def __init__(
        self,
        params,
        lr: float = 0.1,
        weight_decay: float = 0.0,
        sparse_grad_size: int = 10,
        random_sparse: bool = False,
        mode: str | None = None,
        generator: torch.Generator | None = None,
        index_fn: Callable[[int, torch.Tensor, int], torch.Tensor] | None = None,
        wd_in_memory: bool = False,
    ):
        self.params = as_param_list(params)
        self.lr = lr
        self.weight_decay = weight_decay
        if sparse_grad_size < 1:
            raise ValueError(f"sparse_grad_size must be >= 1, got {sparse_grad_size}")
        self.sparse_grad_size = sparse_grad_size
        if mode is None:
            mode = "random" if random_sparse else "blockwise"
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.generator = generator
        self.index_fn = index_fn
        self.wd_in_memory = wd_in_memory
        self.memory = [torch.zeros_like(p) for p in self.params]
        self.estimated_w = [p.clone() for p in self.params]
        self.last_indices: list[torch.Tensor | None] = [None] * len(self.params)

    def _select(self, i: int, flat_mem: torch.Tensor, k: int) -> torch.Tensor:
        n = flat_mem.numel()
        if self.index_fn is not None:
            idx = self.index_fn(i, flat_mem, k)
        elif self.mode == "random":
            idx = torch.randperm(n, generator=self.generator)[:k]
        elif self.mode == "blockwise":
            num_blocks = n // k
            b = int(torch.randint(0, num_blocks, (1,), generator=self.generator))
            idx = torch.arange(b * k, b * k + k)
        else:
            idx = torch.topk(flat_mem.abs(), k).indices
        return torch.as_tensor(idx, dtype=torch.long).to(flat_mem.device)

    @torch.no_grad()
    def step(self, grads) -> None:
        grads = check_grads(self.params, grads)
        wd = self.weight_decay
        for i, p, g in with_grads(self.params, grads):
            mem = self.memory[i]
            if self.wd_in_memory and wd != 0:
                mem.add_(self.lr * (g + wd * p))
            else:
                mem.add_(self.lr * g)

            flat_mem = mem.view(-1)
            k = min(self.sparse_grad_size, flat_mem.numel())
            idx = self._select(i, flat_mem, k)
            self.last_indices[i] = idx

            sparse = torch.zeros_like(flat_mem)
            sparse[idx] = flat_mem[idx]
            flat_mem[idx] = 0

            update = sparse.view_as(p)
            if not self.wd_in_memory and wd != 0:
                update = update + wd * p
            p.sub_(update)

    @torch.no_grad()
    def update_estimated_weights(self, iteration: int, sparse_vector_size: int | None = None) -> None:
        if sparse_vector_size is None:
            sparse_vector_size = self.sparse_grad_size
        t = iteration
        for i, p in enumerate(self.params):
            tau = p.numel() / sparse_vector_size
            rho = 6 * (t + tau) ** 2 / ((1 + t) * (6 * tau**2 + t + 6 * tau * t + 2 * t**2))
            self.estimated_w[i] = self.estimated_w[i] * (1 - rho) + p * rho

    def get_estimated_weights(self) -> list[torch.Tensor]:
        return list(self.estimated_w)
