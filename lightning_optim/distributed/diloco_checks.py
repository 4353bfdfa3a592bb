"""The checks of :class:`~lightning_optim.distributed.diloco.DiLoCo`'s arguments, and how its construction
agreement shows a differing value (every refusal names the argument and its valid range)."""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_optim.comm.agreement import fingerprint
from lightning_optim.optim.validation import check_flag, check_int, check_positive, check_unit_interval

from .agreement import bits_float
from .centralized import GenericCentralizedOptimizer
from .communicating import CommunicatingOptimizer
from .compressed_checks import check_distinct_params, check_float_params
from .decentralized import DecentralizedSGD
from .diloco_exchange import COMPRESSORS

__all__ = ["DEFAULT_MIXING", "check_diloco_arguments", "check_inner", "check_settings", "compressor_code", "show"]

DEFAULT_MIXING = 0.5


def check_inner(inner: object, wrapper: type) -> list[Tensor]:
    """The inner optimizer's params, or the refusal naming ``inner`` (``wrapper``: the DiLoCo class itself)."""
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(f"inner must be a torch.optim.Optimizer over the model's params (ours or torch's), got "
                        f"{type(inner).__name__}")
    if isinstance(inner, wrapper):
        raise TypeError("inner: a DiLoCo cannot wrap another DiLoCo; wrap its inner optimizer")
    if isinstance(inner, (CommunicatingOptimizer, GenericCentralizedOptimizer, DecentralizedSGD)):
        raise ValueError(f"inner: {type(inner).__name__} communicates at every step; DiLoCo needs a local optimizer "
                         "(e.g. lightning_optim.AdamW or torch.optim.AdamW) and does the communication itself")
    if getattr(inner, "gradient_release", False):
        raise ValueError("inner: under gradient release the inner step runs inside backward, outside DiLoCo.step(); "
                         "use it without prepare_for_gradient_release")
    params = [p for group in inner.param_groups for p in group["params"]]
    check_distinct_params(params)
    check_float_params(params)
    return params


def check_settings(params: list[Tensor], sync_every: object, fragments: object, outer_lr: object,
                    outer_momentum: object, nesterov: object, overlap: object, mixing: object,
                    final_sync: object) -> dict[str, Any]:
    settings = check_diloco_arguments(sync_every, fragments, outer_lr, outer_momentum, nesterov, overlap, mixing,
                                      final_sync)
    if settings["fragments"] > len(params):
        raise ValueError(f"fragments must be in [1, {len(params)}] (the inner optimizer's {len(params)} params, one "
                         f"at least per fragment), got {settings['fragments']}")
    return settings


def check_diloco_arguments(sync_every: object, fragments: object = 1, outer_lr: object = 0.7,
                           outer_momentum: object = 0.9, nesterov: object = True, overlap: object = False,
                           mixing: object = None, final_sync: object = True) -> dict[str, Any]:
    """The checks of :class:`DiLoCo`'s arguments that need no params (for adapters that wrap an optimizer
    later): the settings with ``mixing`` resolved, or ``TypeError``/``ValueError`` naming the argument."""
    sync_every = check_int("sync_every", sync_every, 1)
    fragments = check_int("fragments", fragments, 1)
    if fragments > sync_every or sync_every % fragments:
        raise ValueError(f"fragments must divide sync_every={sync_every} (one fragment every sync_every/fragments "
                         f"steps), so lie in [1, {sync_every}], got {fragments}")
    outer_lr = check_positive("outer_lr", outer_lr)
    outer_momentum = check_unit_interval("outer_momentum", outer_momentum)
    check_flag("nesterov", nesterov)
    if nesterov and outer_momentum == 0:
        raise ValueError("nesterov=True needs outer_momentum in (0, 1), got 0.0 (or pass nesterov=False)")
    check_flag("overlap", overlap)
    if mixing is not None:
        if not overlap:
            raise ValueError(f"mixing={mixing!r} is only used with overlap=True (without overlap every rank takes "
                             "the global params); leave it None")
        mixing = check_unit_interval("mixing", mixing, closed_right=True)
    elif overlap:
        mixing = DEFAULT_MIXING
    check_flag("final_sync", final_sync)
    return dict(sync_every=sync_every, fragments=fragments, outer_lr=outer_lr, outer_momentum=outer_momentum,
                nesterov=nesterov, overlap=overlap, mixing=mixing, final_sync=final_sync)


def compressor_code(name: str) -> int:
    """0: none; 1 + i: the i-th name of ``COMPRESSORS``; else a checksum of the instance's class name."""
    names = ["none", *COMPRESSORS]
    return names.index(name) if name in names else fingerprint([name]) + len(names)


def show(field: str, value: int) -> str:
    """A differing value of the construction agreement as a person reads it."""
    if field in ("outer_lr", "outer_momentum", "mixing"):
        number = bits_float(value)
        return "None" if field == "mixing" and number == -1.0 else repr(number)
    if field == "compressor":
        names = ["none", *COMPRESSORS]
        return repr(names[value]) if value < len(names) else f"a Compressor instance (class checksum {value:x})"
    if field == "shapes":
        return f"checksum {value & 0xFFFFFFFF:08x}"
    return repr(bool(value)) if field in ("overlap", "nesterov", "final_sync") else str(value)
