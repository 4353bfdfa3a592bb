"""The checks of :class:`~lightning_optim.distributed.diloco.DiLoCo`'s arguments, and how its construction
agreement shows a differing value (every refusal names the argument and its valid range).

The outer step's defaults depend on the recipe, and live in :data:`OUTER_DEFAULTS` alone: ``"dense"`` (DiLoCo's
outer Nesterov SGD, every compressor but SparseLoCo) and ``"sparseloco"`` (``compressor="sparseloco"`` or a
:class:`~lightning_optim.comm.compressors.SparseLoCo`: no outer momentum buffer, ``outer_momentum`` is the decay
of the error-feedback accumulator). :func:`resolve_outer` fills the arguments left None from it.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_optim.comm.agreement import fingerprint
from lightning_optim.comm.compressors import Compressor, SparseLoCo
from lightning_optim.optim.validation import check_flag, check_int, check_positive, check_unit_interval

from .agreement import bits_float
from .centralized import GenericCentralizedOptimizer
from .communicating import CommunicatingOptimizer
from .compressed_checks import check_distinct_params, check_float_params
from .decentralized import DecentralizedSGD
from .diloco_exchange import COMPRESSORS, resolve_compressor

__all__ = ["DEFAULT_MIXING", "OUTER_DEFAULTS", "check_arguments", "check_diloco_arguments", "check_inner",
           "check_settings", "compressor_code", "recipe", "resolve_outer", "show"]

DEFAULT_MIXING = 0.5
# recipe -> (outer_lr, outer_momentum, nesterov) where they are left None
# (benchmarks/diloco_sweep.py on the main job, 2 replicas, 6-30 outer steps: the papers' 0.7/0.9 ended 8-18% above
# DDP there on the tiny model, 0.8/0.5 2-5%, plain averaging 3-5%; on the small model averaging did best, +4.5% against
# 0.8/0.5's +8.8%; SparseLoCo at densities 1/64-0.06 ended lowest with outer_lr 1.5-2, not 1)
OUTER_DEFAULTS: dict[str, tuple[float, float, bool]] = {"dense": (0.8, 0.5, True), "sparseloco": (2.0, 0.95, False)}


def recipe(compressor: object) -> str:
    """``"sparseloco"`` for ``compressor="sparseloco"`` or a SparseLoCo instance, else ``"dense"``."""
    return "sparseloco" if compressor == "sparseloco" or isinstance(compressor, SparseLoCo) else "dense"


def resolve_outer(recipe_name: str, outer_lr: object, outer_momentum: object,
                  nesterov: object) -> tuple[object, object, object]:
    """``(outer_lr, outer_momentum, nesterov)`` with each None replaced by ``OUTER_DEFAULTS[recipe_name]``'s."""
    defaults = OUTER_DEFAULTS[recipe_name]
    given = (outer_lr, outer_momentum, nesterov)
    return tuple(d if v is None else v for v, d in zip(given, defaults))  # type: ignore[return-value]


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


def check_settings(params: list[Tensor], *args: object) -> tuple[dict[str, Any], str, Compressor | None]:
    """:func:`check_arguments` (``args``: its arguments), and ``fragments`` against the params."""
    settings, name, prototype = check_arguments(*args)
    if settings["fragments"] > len(params):
        raise ValueError(f"fragments must be in [1, {len(params)}] (the inner optimizer's {len(params)} params, one "
                         f"at least per fragment), got {settings['fragments']}")
    return settings, name, prototype


def _check_outer(kind: str, compressor: object, outer_lr: object, outer_momentum: object,
                 nesterov: object) -> tuple[float, float, bool]:
    own_decay = compressor.decay if isinstance(compressor, SparseLoCo) else None
    given_momentum = outer_momentum
    if outer_momentum is None and own_decay is not None:
        outer_momentum = own_decay  # the instance's decay is the recipe's momentum
    outer_lr, outer_momentum, nesterov = resolve_outer(kind, outer_lr, outer_momentum, nesterov)
    lr = check_positive("outer_lr", outer_lr)
    check_flag("nesterov", nesterov)
    if kind == "dense":
        momentum = check_unit_interval("outer_momentum", outer_momentum)
        if nesterov and momentum == 0:
            raise ValueError("nesterov=True needs outer_momentum in (0, 1), got 0.0 (or pass nesterov=False)")
        return lr, momentum, bool(nesterov)
    momentum = check_unit_interval("outer_momentum", outer_momentum, closed_right=True)
    if nesterov:
        raise ValueError("nesterov=True: SparseLoCo keeps no outer momentum (its error-feedback accumulator, decayed "
                         "by outer_momentum, takes the momentum's place): pass nesterov=False or leave it None")
    if own_decay is not None and momentum != own_decay:
        raise ValueError(f"outer_momentum={given_momentum!r} differs from the SparseLoCo instance's decay="
                         f"{own_decay!r}: with SparseLoCo outer_momentum is the accumulator's decay; leave it None "
                         "or pass the instance's")
    return lr, momentum, False


def check_arguments(sync_every: object, fragments: object = 1, outer_lr: object = None,
                    outer_momentum: object = None, nesterov: object = None, overlap: object = False,
                    mixing: object = None, final_sync: object = True, compressor: object = None,
                    density: object = None, bits: object = None) -> tuple[dict[str, Any], str, Compressor | None]:
    """The checks of :class:`DiLoCo`'s arguments that need no params: ``(settings, compressor name, compressor
    instance)``, the settings with the outer step's and ``mixing``'s defaults resolved, or
    ``TypeError``/``ValueError`` naming the argument."""
    sync_every = check_int("sync_every", sync_every, 1)
    fragments = check_int("fragments", fragments, 1)
    if fragments > sync_every or sync_every % fragments:
        raise ValueError(f"fragments must divide sync_every={sync_every} (one fragment every sync_every/fragments "
                         f"steps), so lie in [1, {sync_every}], got {fragments}")
    resolve_compressor(compressor, density, bits)  # the name, and density/bits with it, before the outer defaults
    kind = recipe(compressor)
    outer_lr, outer_momentum, nesterov = _check_outer(kind, compressor, outer_lr, outer_momentum, nesterov)
    check_flag("overlap", overlap)
    if mixing is not None:
        if not overlap:
            raise ValueError(f"mixing={mixing!r} is only used with overlap=True (without overlap every rank takes "
                             "the global params); leave it None")
        mixing = check_unit_interval("mixing", mixing, closed_right=True)
    elif overlap:
        mixing = DEFAULT_MIXING
    check_flag("final_sync", final_sync)
    name, prototype = resolve_compressor(compressor, density, bits, outer_momentum if kind == "sparseloco" else None)
    if isinstance(prototype, SparseLoCo) and compressor == "sparseloco":
        density, bits = prototype.density, prototype.bits
    settings = dict(sync_every=sync_every, fragments=fragments, outer_lr=outer_lr, outer_momentum=outer_momentum,
                    nesterov=nesterov, overlap=overlap, mixing=mixing, final_sync=final_sync, density=density,
                    bits=bits)
    return settings, name, prototype


def check_diloco_arguments(sync_every: object, fragments: object = 1, outer_lr: object = None,
                           outer_momentum: object = None, nesterov: object = None, overlap: object = False,
                           mixing: object = None, final_sync: object = True, compressor: object = None,
                           density: object = None, bits: object = None) -> dict[str, Any]:
    """The checks of :class:`DiLoCo`'s arguments that need no params (for adapters that wrap an optimizer
    later): DiLoCo's keyword arguments but ``compressor``, with ``mixing``, the outer step's defaults
    (:data:`OUTER_DEFAULTS`) and, for ``compressor="sparseloco"``, ``density``/``bits`` resolved; or
    ``TypeError``/``ValueError`` naming the argument."""
    return check_arguments(sync_every, fragments, outer_lr, outer_momentum, nesterov, overlap, mixing, final_sync,
                           compressor, density, bits)[0]


def compressor_code(name: str) -> int:
    """0: none; 1 + i: the i-th name of ``COMPRESSORS``; else a checksum of the instance's class name."""
    names = ["none", *COMPRESSORS]
    return names.index(name) if name in names else fingerprint([name]) + len(names)


def show(field: str, value: int) -> str:
    """A differing value of the construction agreement as a person reads it."""
    if field in ("outer_lr", "outer_momentum", "mixing", "density"):
        number = bits_float(value)
        return "None" if field in ("mixing", "density") and number == -1.0 else repr(number)
    if field == "bits":
        return "None" if value == 0 else str(value)
    if field == "compressor":
        names = ["none", *COMPRESSORS]
        return repr(names[value]) if value < len(names) else f"a Compressor instance (class checksum {value:x})"
    if field == "shapes":
        return f"checksum {value & 0xFFFFFFFF:08x}"
    return repr(bool(value)) if field in ("overlap", "nesterov", "final_sync") else str(value)
