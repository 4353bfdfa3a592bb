"""What ``BaseOptimizer.load_state_dict`` accepts, and how it is converted, decided before anything
changes: a refused dict leaves the optimizer exactly as it was.

**Sources.** Our own state dicts, and torch.optim's of the same algorithm (``torch.optim.Adam`` /
``AdamW`` into ``Adam``/``AdamW``/``FusedAdam``/``CPUAdam``, ``SGD`` into ``SGD``/``FusedSGD``,
``RAdam`` into ``RAdam``): group keys the source lacks take this optimizer's defaults
(``bias_correction``, ``decouple_lr``, ``kahan_sum`` ...), torch's implementation flags
(``capturable``, ``differentiable``, ``fused``) are dropped, torch's tensor ``step`` becomes an int,
and a state torch leaves empty (``momentum_buffer: None``) counts as no state. The per-param state
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

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from lightning_optim.optim.base import BaseOptimizer

__all__ = ["prepare_state_dict"]

_TORCH_ONLY_FLAGS = ("capturable", "differentiable", "fused")
# defaults that belong to the optimizer, not to a group (BaseOptimizer keeps them out of the groups)
_OPTIMIZER_WIDE = ("gradient_release",)
_ALWAYS_ALLOWED = {"step", "kahan_comp"}


def _step_of(value: Any, where: str) -> int:
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"state_dict: {where} step must be a number, got a tensor of shape {tuple(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 0:
        raise ValueError(f"state_dict: {where} step must be a whole number >= 0, got {value!r}")
    return int(value)




def _convert_tensor(opt: BaseOptimizer, group: dict[str, Any], p: Tensor, key: str, value: Tensor,
                    where: str) -> Tensor | None:
    if key == "kahan_comp":
        if tuple(value.shape) != tuple(p.shape):
            raise ValueError(f"state_dict: {where} kahan_comp has shape {tuple(value.shape)}, the param {tuple(p.shape)}")
        return None if p.dtype == torch.float32 else value.to(device=p.device, dtype=p.dtype, copy=True)
    if value.dim() == 0 or not value.is_floating_point():
        return value.to(device=p.device, copy=True)
    if tuple(value.shape) != tuple(p.shape):
        raise ValueError(f"state_dict: {where} {key} has shape {tuple(value.shape)}, the param {tuple(p.shape)}")
    if value.dtype in (torch.float32, p.dtype):
        return value.to(device=p.device, copy=True)
    return value.to(device=p.device, dtype=opt._configured_compute_dtype(group, p), copy=True)


def prepare_state_dict(opt: BaseOptimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` checked against ``opt`` and converted (new containers; tensors copied onto the
    params' devices). Raises ``ValueError`` naming what is wrong; ``opt`` is never touched."""
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError("state_dict: expected a dict with 'state' and 'param_groups'")
    saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(f"state_dict: {len(saved_groups)} param groups saved, the optimizer has {len(opt.param_groups)}")
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
            merged.update(opt._validate_group({**merged, "params": group["params"]}))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"state_dict: param group {gi}: {exc}") from None
        groups.append(merged)
        live = {**merged, "params": group["params"]}
        for p, pid in zip(group["params"], saved["params"]):
            entry = {k: v for k, v in (saved_state.get(pid) or {}).items() if v is not None}
            if not entry or set(entry) == {"step"}:
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
            converted: dict[str, Any] = {}
            if "step" in entry:
                converted["step"] = _step_of(entry["step"], where)
            elif opt._per_param_steps:
                if opt._implied_step is None:
                    raise ValueError(f"state_dict: {where} has no step count, which {type(opt).__name__} needs")
                converted["step"] = opt._implied_step
            for key, value in entry.items():
                if key == "step":
                    continue
                if isinstance(value, Tensor):
                    value = _convert_tensor(opt, live, p, key, value, where)
                    if value is None:
                        continue
                converted[key] = value
            if p.dtype != torch.float32 and "kahan_comp" not in converted and opt._uses_kahan(live, p):
                converted["kahan_comp"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state[pid] = converted
    return {"state": state, "param_groups": groups}
