"""What ``BaseOptimizer.load_state_dict`` accepts, and how it is converted, decided before anything
changes: a refused dict leaves the optimizer exactly as it was.

**Sources.** Our own state dicts, and torch.optim's of the same algorithm (``torch.optim.Adam`` /
``AdamW`` into ``Adam``/``AdamW``/``FusedAdam``/``CPUAdam``, ``SGD`` into ``SGD``/``FusedSGD``,
``RAdam`` into ``RAdam``): group keys the source lacks take this optimizer's defaults
(``bias_correction``, ``decouple_lr``, ``kahan_sum`` ...), torch's implementation flags
(``capturable``, ``differentiable``, ``fused``) are dropped, every ``step`` (torch's tensor, or the int
of an older checkpoint) becomes a fresh CPU step tensor (:mod:`.steps`), and a state torch leaves empty
(``momentum_buffer: None``) counts as no state. A state holding only ``step`` (momentum-free SGD) is
kept. A saved step that is not a whole number in range (NaN, inf, negative, fractional, a string) is
refused naming its param and key. The per-param state
keys must be the ones this optimizer makes for that param with the loaded hyper-parameters (plus
``step`` and ``kahan_comp``): another algorithm's dict is refused naming the missing and extra keys.

**Dtypes** (each per-element state tensor; 0-d scalars keep theirs):

* fp32 state is never rounded down: loaded into fp16/bf16 params it stays fp32 and those params
  then compute in fp32, as with ``fp32_state=True``;
* a state in the param's own dtype stays as it is;
* any other dtype (bf16 state for fp32 params, fp16 for bf16 ...) becomes the dtype this optimizer
  would create (the param's, or fp32 with ``fp32_state``): an upcast for fp32 params;
* ``kahan_comp`` follows the param: cast to its dtype, dropped for fp32 params, and created (zeros)
  for a low-precision param with Kahan summation on that arrives without one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_optim.optim.steps import check_step, new_step
from lightning_optim.optim.validation import check_generator_state, check_optional_flag


class BaseOptimizer(Protocol):
    """What the loading checks read of the optimizer (``optim.base.BaseOptimizer`` has it; this module
    sits below it and does not import it)."""

    defaults: dict[str, Any]
    param_groups: list[dict[str, Any]]
    _implied_step: int | None
    _per_param_steps: bool

    def _configured_compute_dtype(self, group: dict[str, Any], p: Tensor) -> torch.dtype: ...
    def _state_keys(self, group: dict[str, Any], p: Tensor) -> tuple[set[str], set[str]]: ...
    def _state_template(self, group: dict[str, Any], p: Tensor) -> dict[str, Any]: ...
    def _uses_kahan(self, group: dict[str, Any], p: Tensor) -> bool: ...
    def _validate_group(self, merged: dict[str, Any]) -> dict[str, Any]: ...

__all__ = ["check_state_tensor", "prepare_state_dict", "step_count"]

_TORCH_ONLY_FLAGS = ("capturable", "differentiable", "fused")
# defaults that belong to the optimizer, not to a group (BaseOptimizer keeps them out of the groups)
_OPTIMIZER_WIDE = ("gradient_release",)
_ALWAYS_ALLOWED = {"step", "kahan_comp"}


def step_count(value: Any, where: str, key: str = "step") -> int:
    """A loaded counter (``step``, Ranger's ``la_step``) as an int; see :func:`.steps.check_step`."""
    return check_step(value, f"state_dict: {where} {key}")


def check_state_tensor(where: str, key: str, value: object, shapes: Sequence[tuple[int, ...]],
                       param_shape: tuple[int, ...]) -> Tensor:
    """A loaded state tensor must be real floating-point (an int, bool or complex moment would make every
    later step fail or round) and have one of ``shapes``. Raises ``ValueError`` naming ``key``."""
    if not isinstance(value, Tensor):
        raise ValueError(f"state_dict: {where} {key} must be a tensor, got {type(value).__name__}")
    if not value.is_floating_point():
        raise ValueError(f"state_dict: {where} {key} is a {value.dtype} tensor; optimizer states must be real "
                         "floating-point (float16, bfloat16, float32 or float64)")
    if tuple(value.shape) not in [tuple(s) for s in shapes]:
        raise ValueError(f"state_dict: {where} {key} has shape {tuple(value.shape)}, the param {tuple(param_shape)}")
    return value


def _convert_tensor(opt: BaseOptimizer, group: dict[str, Any], p: Tensor, key: str, value: Tensor,
                    where: str, made: Any) -> Tensor | None:
    # the shape this optimizer makes for the key (0-d scalars such as lamb_coeff), else 0-d or the param's
    shapes = [tuple(made.shape)] if isinstance(made, Tensor) else [(), tuple(p.shape)]
    check_state_tensor(where, key, value, [tuple(p.shape)] if key == "kahan_comp" else shapes, tuple(p.shape))
    if key == "kahan_comp":
        return None if p.dtype == torch.float32 else value.to(device=p.device, dtype=p.dtype, copy=True)
    if value.dim() == 0:
        return value.to(device=p.device, copy=True)
    if value.dtype in (torch.float32, p.dtype):
        return value.to(device=p.device, copy=True)
    return value.to(device=p.device, dtype=opt._configured_compute_dtype(group, p), copy=True)


def _convert_entry(opt: BaseOptimizer, live: dict[str, Any], p: Tensor, entry: dict[str, Any],
                   where: str) -> dict[str, Any]:
    """One param's loaded state, checked key by key against what this optimizer makes for ``p``."""
    template = opt._state_template(live, p)
    converted: dict[str, Any] = {}
    if "step" in entry:
        converted["step"] = new_step(step_count(entry["step"], where))
    elif opt._per_param_steps:
        if opt._implied_step is None:
            raise ValueError(f"state_dict: {where} has no step count, which {type(opt).__name__} needs")
        converted["step"] = new_step(opt._implied_step)
    for key, value in entry.items():
        if key == "step":
            continue
        made = template.get(key)
        if isinstance(made, int) and not isinstance(made, bool):  # a counter (Ranger's la_step)
            converted[key] = step_count(value, where, key)
            continue
        if isinstance(value, Tensor) or isinstance(made, Tensor):
            value = _convert_tensor(opt, live, p, key, value, where, made)
            if value is None:
                continue
        converted[key] = value
    if p.dtype != torch.float32 and "kahan_comp" not in converted and opt._uses_kahan(live, p):
        converted["kahan_comp"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return converted


def prepare_state_dict(opt: BaseOptimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` checked against ``opt`` and converted (new containers; tensors copied onto the
    params' devices). Raises ``ValueError`` naming what is wrong; ``opt`` is never touched."""
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError("state_dict: expected a dict with 'state' and 'param_groups'")
    saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
    if state_dict.get("generator_state") is not None and isinstance(getattr(opt, "generator", None), torch.Generator):
        try:  # SparsifiedSGD restores its generator after the rest: a bad one must stop the load here
            check_generator_state("generator_state", state_dict["generator_state"])
        except ValueError as exc:
            raise ValueError(f"state_dict: {exc}") from None
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(
            f"state_dict: {len(saved_groups)} param groups saved, the optimizer has {len(opt.param_groups)}")
    groups, state = [], {}
    for gi, (group, saved) in enumerate(zip(opt.param_groups, saved_groups)):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(f"state_dict: param group {gi} holds {len(saved['params'])} params, the optimizer's "
                             f"holds {len(group['params'])}")
        merged = {k: v for k, v in saved.items() if k not in _TORCH_ONLY_FLAGS}
        for key, default in opt.defaults.items():
            if key not in _OPTIMIZER_WIDE:
                merged.setdefault(key, default)
        try:
            for flag in _TORCH_ONLY_FLAGS:  # dropped, but a non-flag there means a corrupted dict
                if flag in saved:
                    check_optional_flag(flag, saved[flag])
            merged.update(opt._validate_group({**merged, "params": group["params"]}))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"state_dict: param group {gi}: {exc}") from None
        groups.append(merged)
        live = {**merged, "params": group["params"]}
        for p, pid in zip(group["params"], saved["params"]):
            # a None state is one torch never made (SGD's momentum_buffer); a None step is refused below
            entry = {k: v for k, v in (saved_state.get(pid) or {}).items() if v is not None or k == "step"}
            if not entry:
                continue
            where = f"param {pid} (group {gi})"
            expected, optional = opt._state_keys(live, p)
            missing, extra = expected - set(entry), set(entry) - expected - optional - _ALWAYS_ALLOWED
            if missing or extra:
                raise ValueError(
                    f"state_dict: {where} holds state {sorted(entry)}, but {type(opt).__name__} keeps "
                    f"{sorted(expected | {'step'})} for it (missing: {sorted(missing)}, extra: {sorted(extra)}); "
                    "was it saved by another algorithm?"
                )
            state[pid] = _convert_entry(opt, live, p, entry, where)
    return {"state": state, "param_groups": groups}
