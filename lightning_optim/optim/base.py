"""The machinery every lightning-optim optimizer shares.

An optimizer subclass writes its math once, in ``_update``, over *lists* of tensors with
``torch._foreach_*`` ops. The base calls it either once per bucket of same-device, same-dtype,
same-step tensors (``foreach=True``) or once per tensor with one-element lists (``foreach=False``,
and gradient release). The two paths therefore run the same formula.

Which params step together (buckets, their cached plans, the one-pass grad read) lives in
:mod:`lightning_optim.optim.plans`. Shared features handled here:

* **Validation** of every param group (defaults and per-group overrides) before it is added.
* **Kahan summation** (``kahan_sum``): a low-precision parameter ``p`` with compensation ``c``
  receives an update ``d`` as ``y = d + c; t = round(p + y); c = y - (t - p); p = t``, all
  arithmetic in fp32, so the rounding error of every step is carried into the next one.
* **Weight decay**: L2 (``g <- g + wd p``), torch-style decoupled (``p <- p - lr wd p``) and
  fully decoupled (``decouple_lr``: ``p <- p - (lr / max_lr) wd p``).
* **Optimizer accumulation**: while ``optimizer_accumulation`` is True a step updates the
  states only; the next normal step applies them to the parameters.
* **Gradient release**: see :mod:`lightning_optim.optim.release`.
* **State dicts** keep each state tensor's dtype on reload (torch casts floating state to the
  parameter dtype, which would round fp32 moments of bf16 parameters down); torch's state-dict hooks
  wrap the whole of ours (:mod:`lightning_optim.optim.hooks`).
* **Step counts** are kept as torch.optim keeps them, a 0-dim CPU tensor per param
  (:mod:`lightning_optim.optim.steps`); the math reads them as an int.

Rules for subclasses: never modify ``batch.grads`` in place (they may be ``param.grad``
itself); put scratch results in fresh lists; hand the final parameter delta to ``self._apply``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from lightning_optim import ops
from lightning_optim.ops.fused import decay_coefficient
from lightning_optim.optim import batch as batch_module
from lightning_optim.optim.batch import LOW_PRECISION, Batch, TensorList, bucket_slices, element_chunks
from lightning_optim.optim.flat_params import FLAT_GRAD_ATTR
from lightning_optim.optim.hooks import install_state, load_with_hooks, packed_state_dict, state_dict_with_hooks
from lightning_optim.optim.plans import BucketPlans, check_grad
from lightning_optim.optim.state_dicts import prepare_state_dict
from lightning_optim.optim.steps import new_step
from lightning_optim.optim.validation import (
    check_distinct_params,
    check_flag,
    check_lr,
    check_non_negative,
    check_optional_flag,
    check_positive,
    plain_numbers,
)

ParamsT = Iterable[Tensor] | Iterable[dict[str, Any]]


class BaseOptimizer(BucketPlans, torch.optim.Optimizer):
    """Base class: validation, dispatch, Kahan summation, accumulation, dtype-safe reloads.

    Shared keyword flags (subclasses pass them through ``defaults``):
        weight_decay: decay coefficient, in [0, inf).
        decouple_lr: fully decoupled weight decay, ``p <- p - (lr / max_lr) * wd * p``.
        max_lr: the largest scheduled lr, used by ``decouple_lr`` (defaults to the group's lr).
        kahan_sum: Kahan-compensated updates for fp16/bf16 params (None: on for those dtypes;
            fp32 params need no compensation and never get a buffer).
        foreach: multi-tensor path (None: on). Results equal the for-loop path.
        fp32_state: keep the optimizer states of fp16/bf16 params in fp32 (default False:
            states in the param dtype, as optimi does, to save memory).
        gradient_release: optimi's flag: this optimizer is meant to be driven by
            :func:`prepare_for_gradient_release` (checked now: an optimizer that cannot be released
            refuses it here). ``step(param=p)`` / ``zero_grad(param=p)`` step and free one param, as
            optimi's do; preparing an optimizer built without the flag works too.
    """

    # Our step writes the rounded 16-bit copies of fp32 master params (set_param_copies).
    writes_param_copies = True
    # lr may be a one-element tensor (as in torch.optim, for torch.compile with an LR scheduler: the scheduler
    # fills it in place, the compiled step reads it at run time); the eager step reads it as a float.
    _tensor_lr = True
    # The compiled step of this class hands a tensor lr to its custom op (no .item() in the graph).
    _compiled_tensor_lr = False
    _has_kernel = True  # False: the math is torch ops only, and buckets step in bounded slices
    # True: the update is element by element and writes only state tensors (no norms, no scalars):
    # on the torch path a big tensor may step in pieces, so its temporaries stay within a slice
    _elementwise = False

    def __init__(self, params: ParamsT, defaults: dict[str, Any]) -> None:
        self._optimizer_accumulation = False
        self._released = False
        self._warned_kahan = False
        self._plans: dict[int, tuple[tuple, list[Tensor], list]] = {}  # group id -> (settings, params, plan)
        # One dict per bucket slice of the current plans (ops/coalesce.py), keyed by its first state dict.
        self._run_caches: dict[int, dict[str, Any]] = {}
        self._group_index: dict[int, int] | None = None
        self._param_copies: dict[int, Tensor] = {}
        defaults = {k: plain_numbers(v) for k, v in defaults.items()}
        release = defaults.pop("gradient_release", False)
        check_flag("gradient_release", release)
        super().__init__(params, defaults)
        self.defaults["gradient_release"] = release  # kept out of the groups: not a per-group setting
        if release:
            blocker = self._release_blocker()
            if blocker is not None:
                raise ValueError(f"gradient_release: not possible for {type(self).__name__}: {blocker}")

    # ------------------------------------------------------------------ validation
    def _check_group(self, group: dict[str, Any]) -> None:
        """Subclasses check their own hyper-parameters here (raise ValueError/TypeError)."""

    def _validate_group(self, merged: dict[str, Any]) -> dict[str, Any]:
        """Check a group (defaults merged in); returns the keys to add (``max_lr``). Raises
        ValueError/TypeError naming the argument; shared by ``add_param_group`` and loading."""
        params = merged["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        check_distinct_params(params)  # torch only warns: a repeated param would be stepped twice per step()
        for p in params:
            if isinstance(p, Tensor) and p.is_complex():
                raise TypeError(f"params: complex parameters are not supported (got {p.dtype})")
            if isinstance(p, Tensor) and not p.is_floating_point():
                raise TypeError(f"params: only floating-point parameters can be optimized (got {p.dtype})")
        check_lr(merged["lr"], type(self).__name__, tensor_ok=self._tensor_lr)
        check_non_negative("weight_decay", merged.get("weight_decay", 0.0))
        for flag in ("decouple_lr", "maximize"):
            if flag in merged:
                check_flag(flag, merged[flag])
        for flag in ("kahan_sum", "foreach", "fp32_state", "fused"):
            if flag in merged:
                check_optional_flag(flag, merged[flag])
        added = {}
        if merged.get("decouple_lr") and merged.get("max_lr") is None:
            added["max_lr"] = float(merged["lr"])
        elif merged.get("max_lr") is not None:
            check_positive("max_lr", merged["max_lr"])
        self._check_group({**merged, **added})
        return added

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        param_group = {k: v if k == "params" else plain_numbers(v) for k, v in param_group.items()}
        param_group = {**param_group, **self._validate_group({**self.defaults, **param_group})}
        self._group_index = None
        self.__dict__.setdefault("_plans", {}).clear()
        super().add_param_group(param_group)

    # ------------------------------------------------------------------ public flags
    @property
    def optimizer_accumulation(self) -> bool:
        """While True, steps accumulate gradients into the states and leave params alone."""
        return self._optimizer_accumulation

    @optimizer_accumulation.setter
    def optimizer_accumulation(self, value: bool) -> None:
        check_flag("optimizer_accumulation", value)
        blocker = self._accumulation_blocker() if value else None
        if blocker is not None:
            raise ValueError(f"optimizer_accumulation: not possible: {blocker}")
        self._optimizer_accumulation = value

    def _accumulation_blocker(self) -> str | None:
        """Why gradients cannot be accumulated into this optimizer's states (None: they can)."""
        return None

    @property
    def gradient_release(self) -> bool:
        """True while :func:`prepare_for_gradient_release` hooks drive this optimizer."""
        return self._released

    # ------------------------------------------------------------------ stepping
    def set_param_copies(self, pairs: Iterable[tuple[Tensor, Tensor]]) -> None:
        """``(master, copy)`` pairs: after each update of ``master`` (fp32) the step writes
        ``copy <- round(master)`` (the 16-bit model param), fused into the update where a kernel can.
        Used by :class:`~lightning_optim.precision.MasterWeights`; ``[]`` clears them."""
        copies = {}
        for master, copy in pairs:
            if master.dtype != torch.float32 or copy.shape != master.shape or copy.device != master.device:
                raise ValueError(
                    "set_param_copies: each pair must be an fp32 master and a same-shape copy on its device")
            copies[id(master)] = copy
        self._param_copies = copies

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, param: Tensor | None = None) -> Any:
        """One optimization step over every param with a gradient.

        Under gradient release the update already ran during backward, so only the closure
        (if any) is evaluated. ``param``: step only this one (optimi's gradient-release call).
        """
        if param is not None:
            if closure is not None:
                raise ValueError("closure: cannot be combined with param (a one-param step re-evaluates nothing)")
            self.step_param(param)
            return None
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._released:
            return loss
        # Collect and check every gradient and every state first: bad input or state must not leave
        # a half-done step (no step counter moves before all of them passed).
        work = [(group, *self._params_with_grad(group)) for group in self.param_groups]
        plans = [self._plan(group, params) if params else [] for group, params, _, _ in work]
        self._before_step([(group, params) for group, params, _, _ in work])
        try:
            for (group, params, grads, contiguous), plan in zip(work, plans):
                if params:
                    self._step_params(group, params, grads, plan, contiguous)
        finally:
            self._after_step()
        return loss

    def zero_grad(self, set_to_none: bool = True, param: Tensor | None = None) -> None:
        if param is not None:
            param.grad = None if set_to_none or param.grad is None else param.grad.detach().zero_()
            return
        # Released: the hooks already freed every gradient (under DDP, DDP's finalize wrote the averaged
        # grads back after the hooks stepped: drop them, see comm/ddp_hooks/release.py). Compiling: torch's zero_grad is
        # marked not to be traced (a graph break in every compiled step); set_to_none only drops the grads.
        if self._released or (set_to_none and torch.compiler.is_compiling()):
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad = None
            return
        if set_to_none and self._zero_flat_grads():
            return
        super().zero_grad(set_to_none=set_to_none)

    def _zero_flat_grads(self) -> bool:
        """Zero the grads that are views of a flat buffer (``flatten_parameters``) in place, drop the others;
        False (nothing done) when no param has a flat grad."""
        params = [p for group in self.param_groups for p in group["params"]]
        flat = [getattr(p, FLAT_GRAD_ATTR, None) for p in params]
        if all(view is None for view in flat):
            return False
        keep = []
        for p, view in zip(params, flat):
            if view is not None and p.grad is view:
                keep.append(view)
            else:
                p.grad = None
        if keep:
            torch._foreach_zero_(keep)
        return True

    def _before_step(self, work: list[tuple[dict[str, Any], list[Tensor]]]) -> None:
        """Hook for whole-model work before any update (LAMB's global grad-norm clipping)."""

    def _after_step(self) -> None:
        """Hook run after every ``step()``, also when it raised (drop per-step caches)."""

    def _configured_compute_dtype(self, group: dict[str, Any], p: Tensor) -> torch.dtype:
        """The dtype of the states this optimizer creates for ``p``."""
        if p.dtype in LOW_PRECISION and group.get("fp32_state"):
            return torch.float32
        return p.dtype

    def _compute_dtype(self, group: dict[str, Any], p: Tensor) -> torch.dtype:
        """The configured dtype, or fp32 where a loaded fp32 state of a 16-bit param says so."""
        dtype = self._configured_compute_dtype(group, p)
        if dtype != torch.float32:
            for key, value in self.state.get(p, {}).items():
                if key != "kahan_comp" and isinstance(value, Tensor) and value.dim() and value.dtype == torch.float32:
                    return torch.float32
        return dtype

    def _uses_kahan(self, group: dict[str, Any], p: Tensor) -> bool:
        if group.get("kahan_sum") and p.dtype not in LOW_PRECISION and not self._warned_kahan:
            self._warned_kahan = True
            warnings.warn(
                f"kahan_sum=True has no effect on {p.dtype} params: only float16/bfloat16 params "
                "lose updates to rounding, so they alone get a compensation buffer",
                stacklevel=4,
            )
        return p.dtype in LOW_PRECISION and group.get("kahan_sum") is not False

    def _state_for(self, group: dict[str, Any], p: Tensor) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            dtype = self._compute_dtype(group, p)
            state["step"] = new_step()
            self._init_state(group, p, state, dtype)
            if self._uses_kahan(group, p):
                state["kahan_comp"] = self._new_state(p, "kahan_comp", p.dtype)
        return state

    def _init_state(self, group: dict[str, Any], p: Tensor, state: dict[str, Any], dtype: torch.dtype) -> None:
        """Subclasses create their state tensors (in ``dtype``) here, each with :meth:`_new_state`."""

    def _new_state(self, p: Tensor, key: str, dtype: torch.dtype,
                   memory_format: torch.memory_format = torch.preserve_format) -> Tensor:
        """A zero-filled state ``key`` for ``p``: its view of the bucket's buffer while a plan is being
        built (``StateArena``), else a tensor of its own."""
        arena = self._arena
        view = arena.take(p, key, dtype) if arena is not None else None
        return view if view is not None else torch.zeros_like(p, dtype=dtype, memory_format=memory_format)

    def _step_params(self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor],
                     plan: list | None = None, contiguous: bool = False) -> None:
        apply = not self._optimizer_accumulation
        for idx, states, dtype, steps in plan if plan is not None else self._plan(group, params):
            step = steps.advance(states)  # the count as an int, for the math and the kernels
            try:
                torch_path = (dtype in LOW_PRECISION or not self._has_kernel
                              or ops.backend_for(params[idx[0]].device) == "torch")
                for a, b in bucket_slices(params, idx, torch_path):
                    if b - a == len(params):  # the one bucket, whole: idx is 0..n-1, the lists as they are
                        part_params, part_grads, part_states = params, grads, states
                    else:
                        part = idx[a:b]
                        part_params, part_grads = [params[i] for i in part], [grads[i] for i in part]
                        part_states = states[a:b]
                    pieces = self._pieces(part_params, part_grads, part_states) if torch_path else None
                    if pieces is not None:
                        for piece_param, piece_grad, piece_state in pieces:
                            self._step_batch(group, [piece_param], [piece_grad], [piece_state], step, dtype,
                                             apply, None, contiguous)
                        continue
                    self._step_batch(group, part_params, part_grads, part_states, step, dtype, apply,
                                     self._run_cache(states[a]), contiguous)
            except Exception:
                # a kernel refused (a state tensor replaced by hand after the plan was built): the bucket's
                # count goes back, and the next step rebuilds the plan, which checks every state against
                # its param before anything moves
                steps.rewind(states)
                self.__dict__.get("_plans", {}).pop(id(group), None)
                raise

    def _pieces(self, params: list[Tensor], grads: list[Tensor],
                states: list[dict[str, Any]]) -> list[tuple[Tensor, Tensor, dict[str, Any]]] | None:
        """A lone tensor bigger than a slice, cut into element pieces when the math allows it
        (element-wise, nothing written to the state dict but its tensors, no 16-bit copies to keep)."""
        if (len(params) != 1 or params[0].numel() <= batch_module.TORCH_PATH_SLICE or not self._elementwise
                or self._param_copies):
            return None
        return element_chunks(params[0], grads[0], states[0])

    def _step_batch(self, group: dict[str, Any], params: list[Tensor], grads: TensorList,
                    states: list[dict[str, Any]], step: int, dtype: torch.dtype, apply: bool,
                    run_cache: dict[str, Any] | None = None, contiguous: bool = False) -> None:
        if group.get("maximize"):
            grads = torch._foreach_neg(grads)
        batch = Batch(params, grads, states, step, dtype, run_cache=run_cache, contiguous=contiguous)
        if not (self._compiled_tensor_lr and torch.compiler.is_compiling()):
            group = self.with_float_lr(group)  # compiled Adam/SGD/Lion hand the tensor to their op instead
        copies = [self._param_copies.get(id(p)) for p in params] if apply and self._param_copies else []
        present = [c for c in copies if c is not None]
        if copies and len(present) == len(copies):
            batch.copies = present  # a kernel may write them in its own pass
        self._update(group, batch, apply)
        if not batch.copies_written:
            pairs = [(c, p) for c, p in zip(copies, params) if c is not None]
            if pairs:
                torch._foreach_copy_([c for c, _ in pairs], [p for _, p in pairs])

    def _update(self, group: dict[str, Any], batch: Batch, apply: bool) -> None:
        """Update the states of ``batch``; when ``apply``, also update the parameters."""
        raise NotImplementedError(f"{type(self).__name__} must implement _update")

    # ------------------------------------------------------------------ helpers for subclasses
    @staticmethod
    def decay_rule(group: dict[str, Any]) -> tuple[float, float]:
        """``(wd, max_lr)`` of :func:`~lightning_optim.ops.fused.decay_coefficient` for ``group``
        (``max_lr`` 0: torch's ``lr * wd``)."""
        return group.get("weight_decay", 0.0), float(group["max_lr"]) if group.get("decouple_lr") else 0.0

    @classmethod
    def decoupled_decay(cls, group: dict[str, Any], lr: float | None = None) -> float:
        """The coefficient ``c`` of a decoupled decay ``p <- p - c p`` (0 when not decoupled).

        ``lr`` overrides the group's lr (StableAdamW decays with its clipped lr).
        """
        return decay_coefficient(group["lr"] if lr is None else lr, *cls.decay_rule(group))

    @staticmethod
    def with_float_lr(group: dict[str, Any]) -> dict[str, Any]:
        """``group``, or a shallow copy with a tensor lr read as a float (the lr the step uses)."""
        lr = group["lr"]
        return {**group, "lr": lr.item()} if isinstance(lr, Tensor) else group

    @staticmethod
    def with_l2(batch: Batch, weight_decay: float, grads: TensorList | None = None) -> TensorList:
        """``g + wd * p`` as new tensors (the caller's grads stay untouched).

        ``grads`` defaults to ``batch.grads`` (LAMB passes its clipped gradients).
        """
        grads = batch.grads if grads is None else grads
        if weight_decay == 0:
            return grads
        return torch._foreach_add(grads, batch.params_compute, alpha=weight_decay)

    def _apply(self, batch: Batch, deltas: TensorList, decay: float | list[float] = 0.0) -> None:
        """``p <- p + delta - decay * p``, Kahan-compensated for low-precision params.

        ``decay`` is one coefficient for the batch or one per tensor (StableAdamW's clipped lr).
        ``deltas`` is scratch owned by the caller and may be consumed.
        """
        params = batch.params
        kahan = "kahan_comp" in batch.states[0]
        decays = decay if isinstance(decay, list) else [decay] * len(params)
        if any(decays):
            if kahan or params[0].dtype != deltas[0].dtype:
                torch._foreach_add_(deltas, torch._foreach_mul(batch.params_compute, [-c for c in decays]))
            else:
                torch._foreach_mul_(params, [1 - c for c in decays])  # torch's order: decay, then step
        batch.mark_params_changed()
        if kahan:
            comps = batch.state("kahan_comp")
            y = torch._foreach_add([d.float() for d in deltas], [c.float() for c in comps])
            old = [p.float() for p in params]
            new = torch._foreach_add(old, y)
            for p, n in zip(params, new):
                p.copy_(n)  # rounds to the param dtype
            # what the rounding lost: y - (round(p + y) - p)
            torch._foreach_sub_(y, torch._foreach_sub([p.float() for p in params], old))
            for c, err in zip(comps, y):
                c.copy_(err)
        elif params[0].dtype == deltas[0].dtype:
            torch._foreach_add_(params, deltas)
        else:
            new = torch._foreach_add([p.to(deltas[0].dtype) for p in params], deltas)
            for p, n in zip(params, new):
                p.copy_(n)

    # ------------------------------------------------------------------ gradient release
    def _group_for(self, p: Tensor) -> dict[str, Any]:
        # Looked up at call time by index: load_state_dict replaces the group dicts, and an
        # LR scheduler must keep driving the hooks afterwards.
        if self._group_index is None:
            self._group_index = {
                id(q): gi for gi, group in enumerate(self.param_groups) for q in group["params"]
            }
        return self.param_groups[self._group_index[id(p)]]

    @torch.no_grad()
    def step_param(self, p: Tensor, grad: Tensor | None = None) -> None:
        """Update one parameter from ``grad`` (default: its ``.grad``); used by gradient release."""
        grad = p.grad if grad is None else grad
        if grad is None:
            return
        check_grad(grad)
        self._plans.clear()  # this param's step count now differs from its bucket's
        self._step_params(self._group_for(p), [p], [grad])

    def _release_blocker(self) -> str | None:
        """Why this optimizer cannot run under gradient release (None: it can)."""
        return None

    # ------------------------------------------------------------------ state dicts
    # A state dict without per-param step counts (torch's SGD) stands for this many steps (None: refused).
    _implied_step: int | None = None
    _per_param_steps = True  # False: the step count lives elsewhere (the 1-bit optimizers' schedule)

    def _state_template(self, group: dict[str, Any], p: Tensor) -> dict[str, Any]:
        """What ``_init_state`` makes for ``p``, run on a meta copy (no memory): a loaded state must hold
        a tensor of the same shape where it holds a tensor, a whole number where it holds one."""
        made: dict[str, Any] = {}
        self._init_state(group, torch.empty_like(p, device="meta"), made, self._configured_compute_dtype(group, p))
        return made

    def _state_keys(self, group: dict[str, Any], p: Tensor) -> tuple[set[str], set[str]]:
        """The per-param state keys a loaded dict must hold for ``p`` and those it may hold (besides
        ``step`` and ``kahan_comp``): the keys of :meth:`_state_template`."""
        return set(self._state_template(group, p)), set()

    @torch._disable_dynamo
    def state_dict(self) -> dict[str, Any]:
        """torch's state dict (torch's hooks run around it, as in ``torch.optim.Optimizer``); subclasses add
        their parts in :meth:`_state_dict`."""
        return state_dict_with_hooks(self, self._state_dict)

    def _state_dict(self) -> dict[str, Any]:
        return packed_state_dict(self)

    @torch._disable_dynamo
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ours or torch.optim's state dict of the same algorithm, atomically.

        torch's load pre-hooks see (and may replace) the given dict, its post-hooks the loaded optimizer.
        Everything is checked and converted first (:mod:`lightning_optim.optim.state_dicts`: the
        group keys, the per-param state keys, steps, shapes and the dtype rules); a refused dict changes
        nothing. Every state tensor is a fresh copy in its decided dtype (torch would cast fp32
        moments of a bf16 param down, and share same-dtype tensors with the given dict).
        """
        load_with_hooks(self, state_dict, self._load_state_dict)

    def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The checked load, without hooks (subclasses that keep more state extend it)."""
        prepared = prepare_state_dict(self, state_dict)
        install_state(self, prepared["param_groups"], prepared["state"])
        self._group_index = None
        self._plans.clear()  # new group and state dicts
