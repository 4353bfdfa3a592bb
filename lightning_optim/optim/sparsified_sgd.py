"""Sparsified SGD with memory (Stich, Cordonnier & Jaggi, arXiv 1809.07599) as mlbench-core's
``SparsifiedSGD``/``CentralizedSparsifiedSGD`` on one worker."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_optim.optim.base import BaseOptimizer, Batch, ParamsT
from lightning_optim.optim.validation import check_flag, check_int, check_non_negative, check_positive
from lightning_optim.renames import warn_ignored

__all__ = ["SparsifiedSGD"]

MODES = ("random", "blockwise", "topk")
IndexFn = Callable[[int, Tensor, int], Tensor]


class SparsifiedSGD(BaseOptimizer):
    r"""SGD that applies only ``k = sparse_grad_size`` coordinates of an error-feedback memory per step.

    Per parameter tensor, with gradient :math:`g`, memory :math:`e` (zeros at the start):

    .. math::
        e &\leftarrow e + \eta g \qquad (\text{``wd\_in\_memory``: } e \leftarrow e + \eta (g + \lambda p)) \\
        S &= \text{k coordinates of the flattened tensor (see ``mode``)} \\
        s_S &= e_S,\; s_{\bar S} = 0, \qquad e_S \leftarrow 0 \\
        p &\leftarrow p - s - \lambda p \qquad (\text{``wd\_in\_memory``: } p \leftarrow p - s)

    As in mlbench the decay :math:`\lambda p` acts on the params directly and is *not* scaled by
    the learning rate (its memory only holds the gradient). ``k`` is clamped to the tensor's size.

    Selection ``mode`` (None: mlbench's ``random_sparse`` flag picks "random" or "blockwise"):

    * ``"random"``: ``torch.randperm(numel, generator=generator)[:k]`` (mlbench: ``np.random.choice``
      without replacement);
    * ``"blockwise"``: one of the ``numel // k`` aligned blocks ``[b k, b k + k)``, with
      ``b = torch.randint(0, numel // k, (1,), generator=generator)`` (mlbench: ``np.random.randint``);
      the last ``numel % k`` coordinates are never selected, as in mlbench;
    * ``"topk"``: the k largest :math:`|e|` (the paper's top-k; deterministic, draws nothing).

    Randomness: exactly one draw per parameter with a gradient per applied step, in parameter
    order (group by group), from ``generator`` (the global RNG when None); so an identically seeded
    generator reproduces the indices. ``index_fn(param_index, flat_memory, k) -> indices`` overrides
    ``mode`` (``param_index`` counts params over all groups). The generator's state is saved in the
    state dict (``"generator_state"``) and restored on load, so a reload continues identically.

    While ``optimizer_accumulation`` is on, gradients only go into the memory (no draw, no step).

    Estimated weights (mlbench ``update_estimated_weights``/``get_estimated_weights``): the weighted
    average :math:`\bar w \leftarrow (1-\rho) \bar w + \rho p` with
    :math:`\rho = 6 (t+\tau)^2 / ((1+t)(6\tau^2 + t + 6\tau t + 2t^2))`, :math:`\tau = n / k_s`.
    mlbench starts :math:`\bar w` at the initial params, which it first re-draws from N(0, 0.01);
    here the params are left as given and :math:`\bar w` starts as their copy at the first step
    (a param that never stepped still has its initial value, which is returned).

    Args:
        lr: learning rate, >= 0 (required, as in mlbench).
        weight_decay: decay coefficient, >= 0 (see above).
        sparse_grad_size: k, an int >= 1.
        random_sparse: mlbench's flag: random (True) or blockwise (False) selection.
        mode: "random", "blockwise" or "topk"; overrides ``random_sparse`` (True beside it warns).
        wd_in_memory: route the decay through the memory (the paper's regularised gradient).
        generator: a ``torch.Generator`` for the draws (None: the global RNG; given where nothing is drawn, it warns).
        index_fn: a callable choosing the indices (overrides ``mode``, which then warns).
        maximize: maximize the objective instead (the memory collects :math:`-\eta g`).
        foreach: accepted for uniformity; the optimizer works tensor by tensor in parameter order (True warns).
        kahan_sum, fp32_state: see :class:`BaseOptimizer`.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float,
        weight_decay: float = 0.0,
        sparse_grad_size: int = 10,
        random_sparse: bool = False,
        *,
        mode: str | None = None,
        wd_in_memory: bool = False,
        generator: torch.Generator | None = None,
        index_fn: IndexFn | None = None,
        maximize: bool = False,
        foreach: bool | None = None,
        kahan_sum: bool | None = None,
        fp32_state: bool = False,
        gradient_release: bool = False,
    ) -> None:
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        if index_fn is not None and not callable(index_fn):
            raise TypeError(f"index_fn must be callable or None, got {type(index_fn).__name__}")
        owner = type(self).__name__
        if foreach is True:
            warn_ignored(owner, "foreach", foreach, "it steps tensor by tensor in parameter order, the order its "
                         "random draws follow")
        chooser = "index_fn" if index_fn is not None else f"mode={mode!r}"
        if random_sparse is True and (mode is not None or index_fn is not None):
            warn_ignored(owner, "random_sparse", random_sparse, f"{chooser} picks the coordinates")
        if mode is not None and index_fn is not None:
            warn_ignored(owner, "mode", mode, "index_fn picks the coordinates")
        if generator is not None and (index_fn is not None or mode == "topk"):
            warn_ignored(owner, "generator", generator, f"{chooser} draws nothing from it")
        self.generator = generator
        self.index_fn = index_fn
        self._param_pos: dict[int, int] | None = None
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            sparse_grad_size=sparse_grad_size,
            random_sparse=random_sparse,
            mode=mode,
            wd_in_memory=wd_in_memory,
            maximize=maximize,
            foreach=foreach,
            kahan_sum=kahan_sum,
            fp32_state=fp32_state,
            gradient_release=gradient_release,
        )
        super().__init__(params, defaults)

    def _check_group(self, group: dict[str, Any]) -> None:
        check_int("sparse_grad_size", group["sparse_grad_size"], 1)
        check_flag("random_sparse", group["random_sparse"])
        check_flag("wd_in_memory", group["wd_in_memory"])
        if group["mode"] is not None and group["mode"] not in MODES:
            raise ValueError(f"mode must be one of {MODES} or None, got {group['mode']!r}")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        self._param_pos = None

    def _init_state(self, group: dict[str, Any], p: Tensor, state: dict[str, Any], dtype: torch.dtype) -> None:
        # contiguous, so that the flattened memory is a view
        state["memory"] = self._new_state(p, "memory", dtype, memory_format=torch.contiguous_format)
        state["estimated_w"] = self._new_state(p, "estimated_w", dtype).copy_(p.detach())

    per_tensor = True  # one tensor at a time, in parameter order: the random draws follow it

    # ------------------------------------------------------------------ the update
    def _update(self, group: dict[str, Any], batch: Batch, apply: bool) -> None:
        lr, wd = group["lr"], group["weight_decay"]
        memories = batch.state("memory")
        grads = self.with_l2(batch, wd) if group["wd_in_memory"] else batch.grads
        torch._foreach_add_(memories, grads, alpha=lr)
        if not apply:
            return
        deltas = []
        for p, memory in zip(batch.params, memories):
            flat = memory.view(-1)
            k = min(group["sparse_grad_size"], flat.numel())
            idx = self._select(group, p, flat, k)
            delta = torch.zeros_like(flat)
            delta[idx] = flat[idx]
            flat[idx] = 0
            deltas.append(delta.neg_().view(memory.shape))
        self._apply(batch, deltas, decay=0.0 if group["wd_in_memory"] else wd)

    def _select(self, group: dict[str, Any], p: Tensor, flat: Tensor, k: int) -> Tensor | slice:
        n = flat.numel()
        if self.index_fn is not None:
            return torch.as_tensor(self.index_fn(self._position(p), flat, k), dtype=torch.long, device=flat.device)
        mode = group["mode"] or ("random" if group["random_sparse"] else "blockwise")
        gen = self.generator
        device = gen.device if gen is not None else torch.device("cpu")
        if mode == "random":
            return torch.randperm(n, generator=gen, device=device)[:k].to(flat.device)
        if mode == "blockwise":
            block = int(torch.randint(0, n // k, (1,), generator=gen, device=device))
            return slice(block * k, block * k + k)
        return torch.topk(flat.abs(), k).indices

    def _position(self, p: Tensor) -> int:
        if self._param_pos is None:
            params = [q for group in self.param_groups for q in group["params"]]
            self._param_pos = {id(q): i for i, q in enumerate(params)}
        return self._param_pos[id(p)]

    # ------------------------------------------------------------------ estimated weights
    @torch.no_grad()
    def update_estimated_weights(self, iteration: int, sparse_vector_size: int | None = None) -> None:
        """Move the weighted-average params toward the current ones (mlbench's rule, see the class).

        ``sparse_vector_size`` defaults to each group's ``sparse_grad_size``.
        """
        t = check_non_negative("iteration", iteration)
        if sparse_vector_size is not None:
            check_positive("sparse_vector_size", sparse_vector_size)
        for group in self.param_groups:
            size = group["sparse_grad_size"] if sparse_vector_size is None else sparse_vector_size
            for p in group["params"]:
                state = self.state.get(p)
                if not state:
                    continue  # never stepped: the average of the initial value is that value
                tau = p.numel() / size
                rho = 6 * (t + tau) ** 2 / ((1 + t) * (6 * tau**2 + t + 6 * tau * t + 2 * t**2))
                est = state["estimated_w"]
                est.mul_(1 - rho).add_(p.detach().to(est.dtype), alpha=rho)

    def get_estimated_weights(self) -> list[Tensor]:
        """The weighted-average params, one tensor per param in group order."""
        out = []
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                out.append(state["estimated_w"] if state else p.detach().clone())
        return out

    # ------------------------------------------------------------------ state dicts
    def _state_dict(self) -> dict[str, Any]:
        state_dict = super()._state_dict()
        if self.generator is not None:
            state_dict["generator_state"] = self.generator.get_state()
        return state_dict

    def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super()._load_state_dict(state_dict)
        self._param_pos = None
        saved = state_dict.get("generator_state")
        if saved is not None and self.generator is not None:
            self.generator.set_state(saved)
        elif self.generator is not None and state_dict.get("state"):
            warnings.warn(
                f"{type(self).__name__}: the state_dict holds optimizer state but no 'generator_state', so the "
                "draws go on from this generator's own state, not the saved run's (torch.distributed.checkpoint's "
                "get_optimizer_state_dict keeps only 'state' and 'param_groups')",
                UserWarning,
                stacklevel=6,
            )
