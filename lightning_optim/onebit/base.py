"""What OnebitAdam, ZeroOneAdam and OnebitLamb share: the flat layout of the trained params,
the communication calls, the stage counters, the per-rank checkpoint and the DDP contract.

Every rank runs the same collectives in the same order, so the optimizers never skip a param:
every param with ``requires_grad=True`` (in param-group order, fixed until that set changes)
takes part in every step, and a param without a gradient on this rank counts as a zero
gradient (as DDP treats unused params). The states that are communicated live in one flat
fp32 buffer per state name (the per-param state tensors are views into it), so one call
compresses (one scale per param) or averages the whole model.

Params sharded by FSDP2 (DTensors, see ``onebit/fsdp.py``) are stepped on their local shards
(``Layout.tensors``): states, gradients and updates are this rank's shard, and ``process_group`` is
the group of ranks that hold the same shard (the replicas).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_optim import ops
from lightning_optim.comm import allreduce_mean, check_process_group, gather_rows
from lightning_optim.comm.compressors.hierarchical import HierarchicalOnebitCompressor
from lightning_optim.comm.compressors.onebit import OnebitCompressor
from lightning_optim.comm.hierarchy import check_hierarchical
from lightning_optim.distributed.communicating import CommunicatingOptimizer
from lightning_optim.onebit.checkpoint import OnebitStateDictMixin
from lightning_optim.onebit.layout import Layout, local_tensor
from lightning_optim.onebit.masks import MomentumMaskMixin
from lightning_optim.optim.adam import adam_deltas, adam_first_moment_, adam_second_moment_
from lightning_optim.optim.base import BaseOptimizer, Batch, ParamsT
from lightning_optim.optim.batch import TensorList
from lightning_optim.optim.validation import (
    check_betas,
    check_flag,
    check_non_negative,
    check_positive,
    check_unit_interval,
)

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# comm_backend_name values DeepSpeed knows; we always talk through torch.distributed.
_DEEPSPEED_BACKENDS = ("nccl", "mpi", "hccl", "compressed")
# auto_mask: elements whose sqrt(v) is at most this fraction of their param's RMS sqrt(v) stay still
DEFAULT_AUTO_MASK = 1e-3


def _auto_mask_ratio(value: object) -> float | None:
    """``auto_mask``: True (ratio ``DEFAULT_AUTO_MASK``), False (off: None) or a ratio in [0, 1)."""
    if isinstance(value, bool):
        return DEFAULT_AUTO_MASK if value else None
    if value is None:
        raise TypeError("auto_mask must be True, False or a ratio in [0, 1), got None (False turns it off)")
    return check_unit_interval("auto_mask", value)


class OnebitOptimizer(CommunicatingOptimizer, OnebitStateDictMixin, MomentumMaskMixin, BaseOptimizer):
    """Base of the 1-bit optimizers. Subclasses define:

    * ``_flat_keys`` / ``_lazy_flat_keys``: the per-param fp32 state tensors kept in flat
      buffers, from the first step / from the stage that creates them with :meth:`_flat`;
    * ``_initial_schedule()``: the stage counters (plain Python numbers, saved in checkpoints);
    * ``_init_param_state(group, p, state)``: per-param scalars (the flat keys are made here);
    * ``_onebit_step(layout, t)``: step ``t`` (1-based), grads already in ``self._grads``;
    * ``_needs_average(t)``: whether step ``t`` consumes rank-averaged full-precision gradients.
    """

    _tensor_lr = False  # the 1-bit steps use the lr in their own Python math

    _flat_keys: tuple[str, ...] = ("exp_avg", "exp_avg_sq")
    _lazy_flat_keys: tuple[str, ...] = ()  # flat states created only in a later stage
    _plain_state_extras: tuple[str, ...] = ()  # per-param keys a full-precision state may bring along
    _optional_state_keys: tuple[str, ...] = ()  # per-param keys made in a later stage (not flat)
    writes_param_copies = False  # the flat step leaves 16-bit copies to MasterWeights.masters_to_model
    _per_param_steps = False  # the schedule holds the step count

    def __init__(
        self,
        params: ParamsT,
        defaults: dict[str, Any],
        *,
        process_group: Any,
        average_grads: bool,
        cuda_aware: bool,
        comm_backend_name: str,
        auto_mask: bool | float = True,
        gradient_release: bool = False,
        hierarchical: bool | int = False,
    ) -> None:
        self.average_grads = check_flag("average_grads", average_grads)
        self.hierarchical = check_hierarchical(hierarchical)
        self.auto_mask = _auto_mask_ratio(auto_mask)
        self.process_group = check_process_group("process_group", process_group)
        self._check_compat(cuda_aware, comm_backend_name, defaults.get("max_grad_norm", 0.0))
        self._sched: dict[str, Any] = self._initial_schedule()
        self._layout: Layout | None = None
        self._flats: dict[str, Tensor] = {}
        self._flat_views: dict[str, list[Tensor]] = {}
        self._param_grads: list[Tensor | None] | None = None
        # its error buffers are this rank's own (hierarchical: for this rank's shard of its node's mean)
        self.compressor = HierarchicalOnebitCompressor(self.hierarchical) if self.hierarchical else OnebitCompressor()
        super().__init__(params, {**defaults, "gradient_release": gradient_release})

    # ------------------------------------------------------------------ arguments
    def _check_compat(self, cuda_aware: object, comm_backend_name: object, max_grad_norm: object) -> None:
        name = type(self).__name__
        check_flag("cuda_aware", cuda_aware)
        backends = (*_DEEPSPEED_BACKENDS, "gloo")
        if comm_backend_name not in backends:
            raise ValueError(f"comm_backend_name must be one of {backends}, got {comm_backend_name!r}")
        if comm_backend_name not in ("nccl", "gloo") or cuda_aware:
            warnings.warn(
                f"{name}: comm_backend_name={comm_backend_name!r}, cuda_aware={cuda_aware} are accepted for "
                "DeepSpeed config compatibility only; communication always goes through the torch.distributed "
                "process group (its own backend: nccl, gloo, ...)",
                UserWarning,
                stacklevel=4,
            )
        if check_non_negative("max_grad_norm", max_grad_norm) > 0:
            warnings.warn(
                f"{name}: max_grad_norm is ignored (as in DeepSpeed); clip gradients before step(), e.g. with "
                "Trainer(gradient_clip_val=...)",
                UserWarning,
                stacklevel=4,
            )

    def _check_group(self, group: dict[str, Any]) -> None:
        check_betas(group["betas"])
        check_positive("eps", group["eps"])
        check_non_negative("max_grad_norm", group.get("max_grad_norm", 0.0))  # a loaded group too
        for flag in ("bias_correction", "eps_inside_sqrt"):
            check_flag(flag, group[flag])
        params = group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        for p in params:
            if p.dtype not in SUPPORTED_DTYPES:
                raise TypeError(
                    f"params: {type(self).__name__} supports float32/float16/bfloat16 params, got {p.dtype}")
        mask = group.get("exp_avg_mask")
        if mask is not None:
            if not isinstance(mask, Tensor) or not mask.is_floating_point():
                raise TypeError(f"exp_avg_mask must be a floating-point tensor, got {type(mask).__name__}")
            for p in params:
                try:
                    fits = torch.broadcast_shapes(mask.shape, p.shape) == p.shape
                except RuntimeError:
                    fits = False
                if not fits:
                    raise ValueError(
                        f"exp_avg_mask: shape {tuple(mask.shape)} does not broadcast to the param shape "
                        f"{tuple(p.shape)}"
                    )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_sched", None) is not None and self._variance_frozen():
            raise ValueError(
                f"add_param_group: {type(self).__name__} froze its variance at step {self._variance_freeze_step()}; "
                "params added later would have no variance estimate for the compression stage. Add every param "
                "before that step (or build a new optimizer from this one's state)"
            )
        super().add_param_group(param_group)

    def _accumulation_blocker(self) -> str | None:
        return "1-bit optimizers communicate in every step; accumulate gradients instead"

    def _release_blocker(self) -> str | None:
        return "1-bit optimizers communicate the whole model's momentum at once"

    def _configured_compute_dtype(self, group: dict[str, Any], p: Tensor) -> torch.dtype:
        return torch.float32  # states, error buffers and communication are fp32 for every param dtype

    def _state_template(self, group: dict[str, Any], p: Tensor) -> dict[str, Any]:
        # the flat keys are param-shaped views of the flat buffers; the scalars come from _init_param_state
        made: dict[str, Any] = {}
        p = local_tensor(p)  # a sharded param's states are its shard's
        self._init_param_state(group, torch.empty_like(p, device="meta"), made)
        for key in self._flat_keys + self._lazy_flat_keys:
            made[key] = torch.empty_like(p, dtype=torch.float32, device="meta")
        return made

    def _state_keys(self, group: dict[str, Any], p: Tensor) -> tuple[set[str], set[str]]:
        scalars: dict[str, Any] = {}
        self._init_param_state(group, torch.empty_like(local_tensor(p), device="meta"), scalars)
        return set(self._flat_keys), set(self._lazy_flat_keys) | set(scalars) | set(self._optional_state_keys)

    # ------------------------------------------------------------------ the DDP contract (CommunicatingOptimizer)
    def _steps_taken(self) -> int:
        return self._sched["step"]

    @property
    def params_synchronized(self) -> bool:
        """Whether the last step left the params identical on every rank (ZeroOneAdam's local
        steps do not; checkpoint at a synchronised step or save the params per rank)."""
        return True

    @property
    def global_step(self) -> int:
        """The number of steps taken (every stage decision is made from it)."""
        return self._sched["step"]

    # ------------------------------------------------------------------ stepping
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]  # no one-param step
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        trained = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        for p in trained:  # all checks before any state exists or changes
            g = p.grad
            if g is not None and g.is_sparse:
                raise ValueError(f"grad: {type(self).__name__} does not support sparse gradients")
        t = self._sched["step"] + 1
        self._warn_if_ddp_unmanaged(t)
        layout = self._prepare_layout()
        self._agree(layout, t)
        grads = [None if p.grad is None else local_tensor(p.grad) for p in layout.params]
        self._drop_foreign_errors()
        if self._reads_param_grads(t):
            self._param_grads = grads
        else:
            self._param_grads = None
            _flat, views = self._scratch(layout, "grad")
            present = [(i, g) for i, g in enumerate(grads) if g is not None]
            if present:
                torch._foreach_copy_([views[i] for i, _ in present], [g for _, g in present])
            if len(present) < len(grads):
                for i, g in enumerate(grads):
                    if g is None:
                        views[i].zero_()
        try:
            if layout.params:
                self._onebit_step(layout, t)
        finally:
            self._param_grads = None  # keeps no gradient alive past the step
        self._sched["step"] = t
        return loss

    def _prepare_layout(self) -> Layout:
        current = self._layout
        key = tuple(id(p) for group in self.param_groups for p in group["params"] if p.requires_grad)
        if (current is not None and current.key == key and (not key or current.params[0].device == current.device)
                and current.refresh()):
            self._relink(current)
            return current
        layout = Layout(self.param_groups)
        if self._variance_frozen():
            fresh = sum(1 for p in layout.params if "exp_avg_sq" not in self.state.get(p, {}))
            if fresh:
                raise ValueError(
                    f"params: {fresh} of {len(layout.params)} trained params have no variance estimate, but "
                    f"{type(self).__name__} froze its variance at step {self._variance_freeze_step()} (params added "
                    "or set to requires_grad=True after it); train them from the start, or build a new optimizer"
                )
        self._flats = {}
        buckets: dict[tuple, list[int]] = {}
        for i, (p, t, gi) in enumerate(zip(layout.params, layout.tensors, layout.group_of)):
            group = self.param_groups[gi]
            state = self.state[p]
            self._init_param_state(group, t, state)  # adds only what is missing (a plain Adam state has no scalars)
            if "kahan_comp" not in state and self._uses_kahan(group, p):
                state["kahan_comp"] = torch.zeros_like(t, memory_format=torch.preserve_format)
            buckets.setdefault((gi, p.dtype, "kahan_comp" in state), []).append(i)
        layout.buckets = [(bucket[0], idx) for bucket, idx in buckets.items()]
        self._layout = layout
        for name in self._flat_keys:
            self._flat(name)
        for name in self._lazy_flat_keys:
            if self._has_state(name):
                self._flat(name)  # made in a later stage; a checkpoint brought it back
        return layout

    def _agree(self, layout: Layout, t: int) -> None:
        """Every rank steps the same params (count, elements, shapes, dtypes) at the same step: one
        bounded all_gather of 40 bytes per step, before any data moves, so a rank whose param set
        changed is reported with the real figures on every rank instead of pairing its collectives
        with another rank's."""
        world, _ = self._world()
        if world == 1:
            return
        device = layout.device if dist.get_backend(self.process_group) == "nccl" else torch.device("cpu")
        rows = gather_rows("all_gather(layout)", (*layout.signature(), t), group=self.process_group, device=device)
        if len(set(rows)) > 1:
            detail = ", ".join(f"rank {r}: {n} params / {numel} elements at step {step}"
                               for r, (n, numel, _, _, step) in enumerate(rows))
            differ = [what for i, what in ((2, "shapes"), (3, "dtypes")) if len({row[i] for row in rows}) > 1]
            raise ValueError(
                f"params: {type(self).__name__} needs the same trainable params (shapes, dtypes, order) on every "
                f"rank, stepping together ({detail}; {' and '.join(differ) or 'no shape or dtype'} differ)"
            )

    # ------------------------------------------------------------------ flat buffers
    def _flat(self, key: str) -> Tensor:
        """The flat fp32 buffer behind state ``key``; made (zeros, or from existing per-param
        tensors, e.g. after a reload) on first use, the per-param states become views into it."""
        flat = self._flats.get(key)
        if flat is None:
            layout = self._built_layout()
            flat = torch.zeros(layout.numel, dtype=torch.float32, device=layout.device)
            views = layout.views(flat)
            for p, view in zip(layout.params, views):
                old = self.state[p].get(key)
                if old is not None:
                    view.copy_(local_tensor(old))
                self.state[p][key] = view
            self._flats[key] = flat
            self._flat_views[key] = views
        return flat

    def _relink(self, layout: Layout) -> None:
        """Re-adopt the flat buffers whose per-param views were replaced from outside (e.g.
        Lightning's ``_optimizer_to_device`` copies state tensors), so they stay the truth."""
        for key in list(self._flats):
            views = self._flat_views[key]
            if not all(self.state[p].get(key) is v for p, v in zip(layout.params, views)):
                del self._flats[key]
                self._flat(key)

    def _has_state(self, key: str) -> bool:
        params = self._built_layout().params
        return bool(params) and key in self.state[params[0]]

    def _built_layout(self) -> Layout:
        """The layout of the params (built by the first step's ``_prepare_layout``)."""
        if self._layout is None:
            raise RuntimeError(f"{type(self).__name__}: no layout yet (the first step builds it)")
        return self._layout

    @staticmethod
    def _scratch(layout: Layout, key: str) -> tuple[Tensor, list[Tensor]]:
        """A flat fp32 work buffer (not state), allocated once per layout, and its views."""
        entry = layout.scratch.get(key)
        if entry is None:
            flat = torch.zeros(layout.numel, dtype=torch.float32, device=layout.device)
            entry = layout.scratch[key] = (flat, layout.views(flat))
        return entry

    def _batches(
        self, layout: Layout, t: int, grads: list[Tensor] | None = None
    ) -> Iterator[tuple[int, dict, Batch]]:
        """(group index, group, Batch) per (group, param dtype, Kahan) bucket; ``grads``
        defaults to the views of the flat gradient buffer."""
        grads = self._scratch(layout, "grad")[1] if grads is None else grads
        for gi, idx in layout.buckets:
            yield gi, self.param_groups[gi], Batch(
                [layout.tensors[i] for i in idx], [grads[i] for i in idx],
                [self.state[layout.params[i]] for i in idx], t, torch.float32
            )

    @staticmethod
    def _param_values(batch: Batch) -> list[Tensor]:
        """The params in fp32, Kahan compensation included (new tensors)."""
        values = [p.float().clone() for p in batch.params]
        if "kahan_comp" in batch.states[0]:
            torch._foreach_add_(values, [c.float() for c in batch.state("kahan_comp")])
        return values

    @staticmethod
    def _assign(batch: Batch, values: TensorList) -> None:
        """Set the params to fp32 ``values``; what rounding loses goes to the Kahan buffer."""
        for p, v in zip(batch.params, values):
            p.copy_(v)
        if "kahan_comp" in batch.states[0]:
            for p, v, c in zip(batch.params, values, batch.state("kahan_comp")):
                c.copy_(v - p.float())
        batch.mark_params_changed()

    def _adam_step(self, group: dict[str, Any], batch: Batch, *, beta1: float, beta2: float, bc1: float,
                   bc2: float, momentum_is_state: bool = False) -> None:
        """``m <- lerp(m, g, 1 - beta1)``, ``v <- beta2 v + (1 - beta2) g^2`` (g: ``batch.grads``), then
        Adam's step with decoupled decay ``lr * weight_decay``. ``beta1 = 0`` takes ``g`` as the
        momentum (e.g. the views of a compressed-averaged ``m``), ``beta2 = 1`` keeps ``v`` frozen.
        ``momentum_is_state`` (with ``beta1 = 0, beta2 = 1``): ``g`` are the ``exp_avg`` states themselves, so
        the kernel only reads ``m`` and ``v`` (``adam_frozen``: no write-back of either).
        Runs the compiled Adam kernel (one pass) where available."""
        decay = group["lr"] * group["weight_decay"]
        kernel = None if group["eps_inside_sqrt"] else ops.kernel("adam", batch)
        if kernel is not None:
            kernel(batch, True, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], l2=0.0, bc1=bc1, bc2=bc2,
                   decay_rule=(group["weight_decay"], 0.0), amsgrad=False, frozen=momentum_is_state)
            return
        exp_avg, exp_avg_sq = batch.state("exp_avg"), batch.state("exp_avg_sq")
        adam_first_moment_(exp_avg, batch.grads, beta1)
        if beta2 != 1.0:
            adam_second_moment_(exp_avg_sq, batch.grads, beta2)
        deltas = adam_deltas(exp_avg, exp_avg_sq, lr=group["lr"], bc1=bc1, bc2=bc2, eps=group["eps"],
                             eps_inside_sqrt=group["eps_inside_sqrt"])
        self._apply(batch, deltas, decay=decay)

    # ------------------------------------------------------------------ communication
    def _average_(self, flat: Tensor) -> None:
        """Full-precision mean over ranks, in place (nothing on one rank); ``hierarchical``: reduce-scatter in
        the node, mean across nodes, all-gather in the node (``comm/hierarchy.py``)."""
        if self._world()[0] > 1 and flat.numel():
            if self.hierarchical:
                self.compressor.average_flat_(flat, group=self.process_group)
            else:
                allreduce_mean(flat, group=self.process_group)

    def average_(self, flat: torch.Tensor) -> torch.Tensor:
        """The warmup's full-precision mean of a flat fp32 vector over ``process_group``, in place, as this
        optimizer averages (hierarchically when ``hierarchical``): what a DDP comm hook calls for a bucket."""
        self._average_(flat)
        return flat

    def _compress_(self, flat: Tensor, momentum: tuple[list[Tensor], float] | None = None) -> None:
        """Error-compensated 1-bit mean over ranks, in place (nothing on one rank); each param's
        slice of ``flat`` is compressed with its own scale (as DeepSpeed compresses per param).
        ``momentum=(grads, w1)``: first ``slice <- lerp(slice, grad, w1)`` per param (``grads`` in layout
        order), in the compression's first pass."""
        numels = self._built_layout().numels
        if momentum is not None:  # the compression's segments skip empty params
            momentum = ([g for g, n in zip(momentum[0], numels) if n], momentum[1])
        self.compressor.reduce_flat_(flat, group=self.process_group, segments=numels,
                                     on_reset=self._warn_errors_reset, momentum=momentum)

    def _reset_error_buffers(self) -> None:
        self.compressor.reset()

    # ------------------------------------------------------------------ for subclasses
    def _initial_schedule(self) -> dict[str, Any]:
        return {"step": 0}

    def _init_param_state(self, group: dict[str, Any], p: Tensor, state: dict[str, Any]) -> None:
        """Per-param scalar states that ``state`` lacks (the flat keys are created by :meth:`_flat`)."""

    def _schedule_after_plain_steps(self, step: int) -> dict[str, Any]:
        """The schedule after ``step`` steps of a full-precision optimizer (every one a variance update)."""
        return {**self._initial_schedule(), "step": step}

    def _schedule_keys_added_since(self, schedule: dict[str, Any]) -> dict[str, Any]:
        """Values for schedule keys that older checkpoints lack."""
        return {}

    def _onebit_step(self, layout: Layout, t: int) -> None:
        raise NotImplementedError

    def _reads_param_grads(self, t: int) -> bool:
        """Whether step ``t`` reads the params' own gradients (``self._param_grads``, None where a param
        has none) instead of the flat fp32 copy in ``_scratch(layout, "grad")``, which it then skips."""
        return False

    def _local_grads(self, layout: Layout) -> list[Tensor]:
        """The params' gradients of this step, in layout order; a zero tensor where a param has none."""
        return [g if g is not None else torch.zeros_like(t) for t, g in zip(layout.tensors, self._step_param_grads())]

    def _step_param_grads(self) -> list[Tensor | None]:
        """``self._param_grads``, set during a step that reads them (see :meth:`_reads_param_grads`)."""
        if self._param_grads is None:
            raise RuntimeError(f"{type(self).__name__}: the params' gradients are read only during a step that "
                               "keeps them (_reads_param_grads)")
        return self._param_grads

    def _needs_average(self, t: int) -> bool:
        raise NotImplementedError

    def _variance_freeze_step(self) -> int:
        """The step after which the variance stays frozen."""
        raise NotImplementedError

    def _variance_frozen(self) -> bool:
        return self._sched["step"] >= self._variance_freeze_step()

    def _variance_version(self) -> int:
        """Changes whenever the variance may have changed (the zero-mask cache key)."""
        return min(self._sched["step"], self._variance_freeze_step())
