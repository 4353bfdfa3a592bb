"""Argument checks of the centralized optimizers, and their use of the bounded cross-rank agreement.

Each rank checks its own arguments first, without raising; then every rank joins one small
``comm.agreement.agree`` (one row of integers per rank: an error code and what must match). So a
mistake on one rank only (a wrong ``world_size``, another model) makes *every* rank raise a clear
error instead of leaving the others blocked in the first all-reduce. The rank at fault raises its
own error; the others name that rank and argument (one of ``ARGUMENTS``).
"""
from __future__ import annotations

import math
import numbers
import struct
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim.optimizer import required as _torch_required

from lightning_optim.comm.agreement import agree
from lightning_optim.comm.dense import world_size as group_world_size
from lightning_optim.distributed.compressed_checks import check_distinct_params
from lightning_optim.optim.validation import check_int
from lightning_optim.renames import warn_ignored

# torch's "no default" sentinel of a required lr (mlbench's signatures), typed Any: it stands as a float's default
required: Any = _torch_required

__all__ = ["ARGUMENTS", "AVERAGES", "SETUP_FIELDS", "bits_float", "check_denom", "check_module", "check_required_lr",
           "check_step_inputs", "check_then_agree", "check_world_size", "float_bits", "model_params", "show_setup",
           "warn_use_cuda"]

# Every argument a centralized optimizer takes: an error's code is 1 + its index here.
ARGUMENTS = ("world_size", "model", "optimizer", "use_cuda", "by_layer", "divide_before", "agg_grad", "grad_clip",
             "average_world", "average_custom", "lr", "momentum", "dampening", "weight_decay", "nesterov", "betas",
             "eps", "amsgrad", "params", "denom")
# What every rank must agree on at construction, and the divisor choices (by index in that row).
SETUP_FIELDS = ("param count", "param elements", "param shapes", "param dtypes", "by_layer", "divide_before",
                "agg_grad", "average", "grad_clip")
AVERAGES = ("world", "custom", "sum")


def float_bits(value: float) -> int:
    """The IEEE-754 bits of ``value`` as an int64: exact comparison across ranks."""
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def bits_float(bits: int) -> float:
    """The inverse of ``float_bits``."""
    return struct.unpack("<d", struct.pack("<q", int(bits)))[0]


def warn_use_cuda(owner: str, use_cuda: object, params: Sequence[Tensor]) -> None:
    """mlbench's ``use_cuda=True`` moves its buffers to CUDA; here they stay on the params' device: say so
    where that is not CUDA (on CUDA params the flag's effect is what happens anyway)."""
    devices = sorted({str(p.device) for p in params if p.device.type != "cuda"})
    if use_cuda and devices:
        warn_ignored(owner, "use_cuda", use_cuda, f"the buffers stay on the params' device ({', '.join(devices)}); "
                     "move the model to CUDA to communicate from there")


def check_world_size(world_size: object) -> int:
    """``world_size`` (None: the default group's size) must equal the group's size."""
    actual = group_world_size()
    if world_size is None:
        return actual
    value = check_int("world_size", world_size, 1)
    if value != actual:
        where = (f"torch.distributed's default process group has {actual} rank(s)" if dist.is_initialized()
                 else "no torch.distributed process group is initialized (one process)")
        raise ValueError(f"world_size must be the number of ranks ({actual}) or None, got {value}: {where}")
    return value


def model_params(model: object, optimizer: object) -> list[Tensor]:
    """The optimizer's params, in group order; each must be a floating-point param of ``model``."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__} ({model!r:.80})")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer over the model's params, got "
                        f"{type(optimizer).__name__}")
    owned = {id(p) for p in model.parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    check_distinct_params(params)  # torch only warns within a group: the aggregate would step it twice
    foreign = sum(id(p) not in owned for p in params)
    if foreign:
        raise ValueError(f"optimizer must hold only params of the model: {foreign} of its {len(params)} params "
                         "are not in model.parameters()")
    if not params:
        raise ValueError("optimizer must hold at least one param of the model, got none")
    odd = sorted({str(p.dtype) for p in params if not p.is_floating_point()})
    if odd:
        raise TypeError(f"params: only floating-point params can be aggregated, got {', '.join(odd)}")
    if getattr(optimizer, "gradient_release", False):
        raise ValueError("optimizer: under gradient release the local step runs inside backward, before any "
                         "aggregation; use it without prepare_for_gradient_release")
    return params


def check_denom(denom: object) -> float:
    """A custom denominator: a real number or a one-element real tensor, finite and > 0."""
    if isinstance(denom, Tensor):
        if denom.numel() != 1 or denom.is_complex() or denom.dtype == torch.bool:
            raise TypeError(f"denom must be a number or a one-element real tensor, got a {denom.dtype} tensor "
                            f"of shape {tuple(denom.shape)}")
        value = float(denom.item())
    elif isinstance(denom, numbers.Real) and not isinstance(denom, bool):
        value = float(denom)
    else:
        raise TypeError(f"denom must be a number or a one-element real tensor, got {type(denom).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"denom must be in (0, inf), got {value}")
    return value


def show_setup(field: str, value: int) -> str:
    """A value of the construction agreement as a person reads it."""
    if field == "grad_clip":
        return repr(bits_float(value))
    if field == "average":
        return repr(AVERAGES[value])
    if field in ("param shapes", "param dtypes"):
        return f"checksum {value & 0xFFFFFFFF:08x}"
    return repr(bool(value)) if field in ("by_layer", "divide_before", "agg_grad") else str(value)


def check_module(model: object) -> torch.nn.Module:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise ValueError("model must be the plain module, not a DistributedDataParallel: DDP already all-reduces "
                         "the gradients in backward, and the centralized optimizer would aggregate them again "
                         "(pass model.module, without DDP)")
    return model


def check_required_lr(lr: object) -> None:
    if lr is required:
        raise TypeError("lr is required: a learning rate in [0, inf)")


def check_step_inputs(closure: object, tracker: object) -> None:
    if closure is not None and not callable(closure):
        raise TypeError(f"closure must be None or a callable returning the loss, got {type(closure).__name__}")
    if tracker is not None and not all(callable(getattr(tracker, m, None))
                                       for m in ("record_batch_agg", "record_batch_opt_step")):
        raise TypeError("tracker must be None or an mlbench Tracker (with record_batch_agg() and "
                        f"record_batch_opt_step()), got {type(tracker).__name__}")


def check_then_agree(who: str, local: Callable[[], tuple[Any, tuple[int, ...]]], fields: Sequence[str],
                     show: Callable[[str, int], str] | None = None) -> Any:
    """Run ``local()`` (it returns ``(result, row)`` or raises), then ``agree`` across ranks on ``row``
    (named by ``fields``; ``show`` renders a differing value): an error on any rank, or rows that
    differ, raise on every rank. Returns ``result``."""
    error, result, row = None, None, None
    try:
        result, row = local()
    except Exception as exc:  # noqa: BLE001 - reported to every rank by agree, then raised here
        error = exc
    agree(who, fields, row, error=error, arguments=ARGUMENTS, show=show)
    return result
