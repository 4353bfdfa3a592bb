"""How an optimizer groups its params into buckets stepped together (``BaseOptimizer`` inherits it).

A *plan* is, per param group, a list of buckets ``(positions, state dicts, compute dtype, steps)``: the
params with a gradient that share device, dtype, compute dtype, Kahan and step count, so one ``_update`` call
(and one fused kernel call) serves them all. Plans are cached while the same params get gradients and
no state dict was replaced from outside; building one creates missing states, checks loaded ones and
packs each bucket's states back to back (``bucket_states.py``), which lets the kernels take one span
per list (``ops/coalesce.py``). Each bucket slice also gets a dict for the coalescing cache.

``steps`` (:class:`~lightning_optim.optim.steps.BucketSteps`) moves the bucket's step tensors with one op
and gives the math their count as an int.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_optim import ops
from lightning_optim.ops.coalesce import same_items
from lightning_optim.optim.bucket_states import StateArena, check_state, pack_states
from lightning_optim.optim.steps import BucketSteps, new_step, step_value

__all__ = ["BucketPlans", "check_grad"]


class BucketPlans:
    """The bucket plans of an optimizer; expects ``self.state``, ``self._plans``, ``self._state_for``,
    ``self._state_template``, ``self._uses_kahan`` and the compute dtypes from ``BaseOptimizer``."""

    _arena: StateArena | None = None  # set while a plan build creates states

    if TYPE_CHECKING:  # BaseOptimizer's
        state: defaultdict[Tensor, Any]
        _plans: dict[int, tuple[tuple, list[Tensor], list]]

        def _state_for(self, group: dict[str, Any], p: Tensor) -> dict[str, Any]: ...

        def _compute_dtype(self, group: dict[str, Any], p: Tensor) -> torch.dtype: ...

    def _params_with_grad(self, group: dict[str, Any]) -> tuple[list[Tensor], list[Tensor], bool]:
        """The params that have a gradient, those gradients (``p.grad`` is read once: it is not a cheap
        attribute) and whether all of both are dense and contiguous (False: not known)."""
        found = ops.grads_of(group["params"])
        if found is not None:  # one compiled pass
            params, grads, contiguous = found
            if not contiguous:  # a sparse grad is not contiguous: look closer
                for g in grads:
                    check_grad(g)
            return params, grads, contiguous
        params, grads = [], []
        for p in group["params"]:
            g = p.grad
            if g is not None:
                if g.is_sparse:  # torch's grad setter checks shape and dtype, not the layout
                    check_grad(g)
                params.append(p)
                grads.append(g)
        return params, grads, False

    # Optimizers whose math must see one tensor at a time, in parameter order (random draws).
    per_tensor = False

    def _plan(self, group: dict[str, Any],
              params: list[Tensor]) -> list[tuple[list[int], list[dict], torch.dtype, BucketSteps]]:
        """Buckets of ``params`` updated together: same device, dtype, compute dtype, Kahan and
        step count. Cached while the same params get gradients: all members of a bucket then
        step together, so the buckets stay valid (a per-parameter step drops the cache)."""
        per_tensor = group.get("foreach") is False or self.per_tensor
        key = (per_tensor, group.get("fp32_state"), group.get("kahan_sum"))
        cached = self._plans.get(id(group))
        # reuse for the same params, unless someone replaced a state dict from outside (opt.state[p] = {...})
        if cached is not None and cached[0] == key and same_items(cached[1], params, ops.loaded_extension()) and all(
            states[0] is self.state.get(params[idx[0]]) for idx, states, _, _ in cached[2]
        ):
            return cached[2]
        # Under torch.compile this one-off (state creation, storage checks, packing) runs eagerly: one
        # graph break on the first step instead of tracing a zeros_like and a check per param.
        if torch.compiler.is_compiling():
            from lightning_optim.optim.outside_graph import eagerly  # imports torch._dynamo

            return eagerly(self._build_plan, group, params, key, per_tensor)
        return self._build_plan(group, params, key, per_tensor)

    def _build_plan(self, group: dict[str, Any], params: list[Tensor], key: tuple,
                    per_tensor: bool) -> list[tuple[list[int], list[dict], torch.dtype, BucketSteps]]:
        fresh = [p for p in params if not self.state.get(p)]
        # states made in this build are born in one buffer per bucket and name (no pack-time copy)
        self._arena = StateArena.for_params(self, group, fresh) if len(fresh) > 1 else None
        try:
            states = [self._state_for(group, p) for p in params]
        finally:
            self._arena = None
        for state in states:  # a count set by hand as a number becomes the tensor torch.optim keeps
            if not isinstance(state["step"], Tensor):
                state["step"] = new_step(step_value(state["step"]))
        counts = [step_value(state["step"]) for state in states]
        if per_tensor:
            indices = [[i] for i in range(len(params))]
        else:
            by_key: dict[tuple, list[int]] = {}
            for i, (p, s) in enumerate(zip(params, states)):
                bucket_key = (p.device, p.dtype, self._compute_dtype(group, p), counts[i], "kahan_comp" in s)
                by_key.setdefault(bucket_key, []).append(i)
            indices = list(by_key.values())
        buckets = [(idx, [states[i] for i in idx], self._compute_dtype(group, params[idx[0]])) for idx in indices]
        for idx, bucket_states, dtype in buckets:
            for i, state in zip(idx, bucket_states):
                check_state(params[i], state, dtype, i)
        for idx, bucket_states, _ in buckets:
            pack_states([params[i] for i in idx], bucket_states)
        plan = [(idx, bucket_states, dtype, BucketSteps(bucket_states)) for idx, bucket_states, dtype in buckets]
        self._plans[id(group)] = (key, list(params), plan)
        self.__dict__.setdefault("_run_caches", {}).clear()  # state dicts may be new objects with old ids
        return plan

    def _run_cache(self, first_state: dict[str, Any]) -> dict[str, Any] | None:
        """The coalescing cache of the bucket slice starting at ``first_state`` (None under torch.compile:
        the traced step gets its lists as they are)."""
        if torch.compiler.is_compiling():
            return None
        return self.__dict__.setdefault("_run_caches", {}).setdefault(id(first_state), {})


def check_grad(grad: Tensor) -> None:
    # torch's grad setter enforces the param's shape and dtype (so no complex grads on the real
    # params add_param_group admits); sparse gradients are the one layout it lets through.
    if grad.is_sparse:
        raise ValueError("grad: sparse gradients are not supported; use dense gradients")
