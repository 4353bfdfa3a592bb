"""The compiled optimizer kernels as torch custom ops (``torch.ops.lightning_optim.<name>``).

``torch.compile`` cannot look into a pybind function: calling one splits the graph. Registered
through ``torch.library.custom_op`` with the tensors they write named in ``mutates_args`` and a fake
implementation, the kernels become single nodes of the traced graph instead.

Each op has the name, the arguments and the argument order of the binding it wraps
(csrc/bindings.cpp), and its real implementation calls that binding; ``adam_at_step``, ``sgd_at_lr``
and ``lion_at_lr``, what a compiled step calls, take the step count and the lr instead of the scalars
derived from them. The eager optimizer step does
not go through the dispatcher (see :func:`lightning_optim.ops.fused.launch`): boxing five lists of
thousands of tensors and bumping their version counters in Python costs more than the step itself
on small-tensor layouts; the two routes run the same binding.

The ops write their tensors in place and return only the per-tensor sums of the norm passes (a fresh
``(n, 2)`` float64 tensor), so the fakes just describe those.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from lightning_optim.ops import _loader
from lightning_optim.ops.fused import decay_coefficient

__all__ = ["NAMESPACE", "OP_NAMES", "op"]

NAMESPACE = "lightning_optim"

_STATES = ("params", "exp_avgs", "kahan_comps")


def _ext() -> ModuleType:
    return _loader.build()


# ------------------------------------------------------------------ optimizers without a return value
@torch.library.custom_op(f"{NAMESPACE}::adam",
                         mutates_args=(*_STATES, "exp_avg_sqs", "max_exp_avg_sqs", "param_copies"))
def adam(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
         max_exp_avg_sqs: list[Tensor], kahan_comps: list[Tensor], param_copies: list[Tensor], w1: float,
         beta2: float, c2: float, step: float, sqrt_bc2: float, eps: float, l2: float, keep: float,
         neg_decay: float, apply: bool) -> None:
    _ext().adam(params=params, grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs,
                max_exp_avg_sqs=max_exp_avg_sqs, kahan_comps=kahan_comps, param_copies=param_copies, w1=w1,
                beta2=beta2, c2=c2, step=step, sqrt_bc2=sqrt_bc2, eps=eps, l2=l2, keep=keep, neg_decay=neg_decay,
                apply=apply)


# ------------------------------------------------------------------ what a compiled step calls
# The values that change between steps reach these as a symbolic int (the step count) or a 0-dim
# tensor (the lr), never as a float: dynamo specializes float arguments, so a scheduled lr or the bias
# corrections would recompile the step every iteration. Each works out, in Python double as the eager
# step does, the scalars the binding takes (``-lr / bc1``, the decay's keep / neg_decay).
def _decay_args(lr: float, wd: float, max_lr: float) -> dict[str, float]:
    decay = decay_coefficient(lr, wd, max_lr)
    return dict(keep=1 - decay, neg_decay=-decay)


@torch.library.custom_op(f"{NAMESPACE}::adam_at_step",
                         mutates_args=(*_STATES, "exp_avg_sqs", "max_exp_avg_sqs", "param_copies"))
def adam_at_step(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
                 max_exp_avg_sqs: list[Tensor], kahan_comps: list[Tensor], param_copies: list[Tensor], w1: float,
                 beta1: float, beta2: float, c2: float, lr: Tensor, count: int, eps: float, l2: float, wd: float,
                 max_lr: float, apply: bool) -> None:
    """``adam`` at step ``count`` (bias corrections ``1 - beta ** count``) with the lr ``lr`` holds now."""
    lr_now = lr.item()
    bc1, bc2 = 1 - beta1**count, 1 - beta2**count
    _ext().adam(params=params, grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs,
                max_exp_avg_sqs=max_exp_avg_sqs, kahan_comps=kahan_comps, param_copies=param_copies, w1=w1,
                beta2=beta2, c2=c2, step=-lr_now / bc1, sqrt_bc2=math.sqrt(bc2), eps=eps, l2=l2, apply=apply,
                **_decay_args(lr_now, wd, max_lr))


@torch.library.custom_op(f"{NAMESPACE}::sgd_at_lr", mutates_args=("params", "momentum_buffers", "kahan_comps"))
def sgd_at_lr(params: list[Tensor], grads: list[Tensor], momentum_buffers: list[Tensor], kahan_comps: list[Tensor],
              momentum: float, damp_keep: float, l2_pre: float, l2_post: float, lr: Tensor, first: bool,
              nesterov: bool, wd: float, max_lr: float, apply: bool) -> None:
    """``sgd`` with the lr ``lr`` holds now."""
    lr_now = lr.item()
    _ext().sgd(params=params, grads=grads, momentum_buffers=momentum_buffers, kahan_comps=kahan_comps,
               momentum=momentum, damp_keep=damp_keep, l2_pre=l2_pre, l2_post=l2_post, neg_lr=-lr_now, first=first,
               nesterov=nesterov, apply=apply, **_decay_args(lr_now, wd, max_lr))


@torch.library.custom_op(f"{NAMESPACE}::lion_at_lr", mutates_args=_STATES)
def lion_at_lr(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], kahan_comps: list[Tensor],
               w1: float, w2: float, lr: Tensor, wd: float, max_lr: float, apply: bool) -> None:
    """``lion`` with the lr ``lr`` holds now."""
    lr_now = lr.item()
    _ext().lion(params=params, grads=grads, exp_avgs=exp_avgs, kahan_comps=kahan_comps, w1=w1, w2=w2,
                neg_lr=-lr_now, apply=apply, **_decay_args(lr_now, wd, max_lr))


@torch.library.custom_op(f"{NAMESPACE}::sgd", mutates_args=("params", "momentum_buffers", "kahan_comps"))
def sgd(params: list[Tensor], grads: list[Tensor], momentum_buffers: list[Tensor], kahan_comps: list[Tensor],
        momentum: float, damp_keep: float, l2_pre: float, l2_post: float, neg_lr: float, first: bool,
        nesterov: bool, keep: float, neg_decay: float, apply: bool) -> None:
    _ext().sgd(params=params, grads=grads, momentum_buffers=momentum_buffers, kahan_comps=kahan_comps,
               momentum=momentum, damp_keep=damp_keep, l2_pre=l2_pre, l2_post=l2_post, neg_lr=neg_lr, first=first,
               nesterov=nesterov, keep=keep, neg_decay=neg_decay, apply=apply)


@torch.library.custom_op(f"{NAMESPACE}::lion", mutates_args=_STATES)
def lion(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], kahan_comps: list[Tensor], w1: float,
         w2: float, neg_lr: float, keep: float, neg_decay: float, apply: bool) -> None:
    _ext().lion(params=params, grads=grads, exp_avgs=exp_avgs, kahan_comps=kahan_comps, w1=w1, w2=w2,
                neg_lr=neg_lr, keep=keep, neg_decay=neg_decay, apply=apply)


@torch.library.custom_op(f"{NAMESPACE}::adan",
                         mutates_args=(*_STATES, "exp_avg_diffs", "exp_avg_sqs", "prev_grads"))
def adan(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_diffs: list[Tensor],
         exp_avg_sqs: list[Tensor], prev_grads: list[Tensor], kahan_comps: list[Tensor], w1: float, w2: float,
         beta2: float, beta3: float, c3: float, bc1: float, n_coef: float, sqrt_bc3: float, eps: float, step: float,
         first: bool, keep: float, neg_decay: float, apply: bool) -> None:
    _ext().adan(params=params, grads=grads, exp_avgs=exp_avgs, exp_avg_diffs=exp_avg_diffs, exp_avg_sqs=exp_avg_sqs,
                prev_grads=prev_grads, kahan_comps=kahan_comps, w1=w1, w2=w2, beta2=beta2, beta3=beta3, c3=c3,
                bc1=bc1, n_coef=n_coef, sqrt_bc3=sqrt_bc3, eps=eps, step=step, first=first, keep=keep,
                neg_decay=neg_decay, apply=apply)


@torch.library.custom_op(f"{NAMESPACE}::lamb_apply", mutates_args=("params", "kahan_comps"))
def lamb_apply(params: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor], kahan_comps: list[Tensor],
               scales: Tensor, bc1: float, bc2: float, eps: float, wd: float, eps_inside_sqrt: bool) -> None:
    _ext().lamb_apply(params=params, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs, kahan_comps=kahan_comps,
                      scales=scales, bc1=bc1, bc2=bc2, eps=eps, wd=wd, eps_inside_sqrt=eps_inside_sqrt)


@torch.library.custom_op(f"{NAMESPACE}::lars", mutates_args=("params", "momentum_buffers", "kahan_comps"))
def lars(params: list[Tensor], grads: list[Tensor], momentum_buffers: list[Tensor], kahan_comps: list[Tensor],
         scales: Tensor | None, wd: float, lo_clip: float, hi_clip: float, momentum: float, first: bool,
         apply: bool) -> None:
    _ext().lars(params=params, grads=grads, momentum_buffers=momentum_buffers, kahan_comps=kahan_comps,
                scales=scales, wd=wd, lo_clip=lo_clip, hi_clip=hi_clip, momentum=momentum, first=first, apply=apply)


@torch.library.custom_op(f"{NAMESPACE}::stable_apply", mutates_args=("params", "kahan_comps"))
def stable_apply(params: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor], kahan_comps: list[Tensor],
                 scales: Tensor, keeps: Tensor, neg_decays: Tensor, bc2: float, eps: float) -> None:
    _ext().stable_apply(params=params, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs, kahan_comps=kahan_comps,
                        scales=scales, keeps=keeps, neg_decays=neg_decays, bc2=bc2, eps=eps)


# ------------------------------------------------------------------ passes that return per-tensor sums
@torch.library.custom_op(f"{NAMESPACE}::lamb_moments", mutates_args=("exp_avgs", "exp_avg_sqs"))
def lamb_moments(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
                 clip_div: float, l2: float, beta1: float, m_coef: float, beta2: float, c2: float, bc1: float,
                 bc2: float, eps: float, wd: float, eps_inside_sqrt: bool, norms: bool) -> Tensor:
    return _ext().lamb_moments(params=params, grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs,
                               clip_div=clip_div, l2=l2, beta1=beta1, m_coef=m_coef, beta2=beta2, c2=c2, bc1=bc1,
                               bc2=bc2, eps=eps, wd=wd, eps_inside_sqrt=eps_inside_sqrt, norms=norms)


@torch.library.custom_op(f"{NAMESPACE}::lars_norms", mutates_args=())
def lars_norms(params: list[Tensor], grads: list[Tensor]) -> Tensor:
    return _ext().lars_norms(params=params, grads=grads)


@torch.library.custom_op(f"{NAMESPACE}::stable_moments", mutates_args=("exp_avgs", "exp_avg_sqs"))
def stable_moments(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
                   w1: float, beta2: float, c2: float, bc2: float, eps_sq: float, rms: bool) -> Tensor:
    return _ext().stable_moments(params=params, grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs, w1=w1,
                                 beta2=beta2, c2=c2, bc2=bc2, eps_sq=eps_sq, rms=rms)


def _writes_in_place(*args: Any, **kwargs: Any) -> None:
    """The fake of an op that only writes into its arguments: there is no output to describe."""
    return None


def _per_tensor_sums(params: list[Tensor], *args: Any, **kwargs: Any) -> Tensor:
    """The fake of a norm pass: one (first, second) float64 pair per tensor, on the params' device."""
    device = params[0].device if params else torch.device("cpu")
    return torch.empty((len(params), 2), dtype=torch.float64, device=device)


for _op in (adam, adam_at_step, sgd, sgd_at_lr, lion, lion_at_lr, adan, lamb_apply, lars, stable_apply):
    _op.register_fake(_writes_in_place)
for _op in (lamb_moments, lars_norms, stable_moments):
    _op.register_fake(_per_tensor_sums)

# op name (the binding's, or a compiled step's variant) -> the custom op
_OPS = {fn._name: fn for fn in (adam, adam_at_step, sgd, sgd_at_lr, lion, lion_at_lr, adan, lamb_moments, lamb_apply,
                                 lars_norms, lars, stable_moments, stable_apply)}
OP_NAMES = tuple(_OPS)


def op(name: str) -> torch.library.CustomOpDef:
    """The custom op that wraps the binding ``name``."""
    return _OPS[name]
