"""Optimizer-facing wrappers around the compiled kernels.

Each wrapper takes the optimizer's :class:`~lightning_optim.optim.base.Batch`, the ``apply`` flag
(False: optimizer accumulation, states only) and the scalars the optimizer computed for this
step, and runs the whole bucket in one call. The scalars are turned into the exact fp32 constants
the foreach path uses (``1 - beta``, ``-lr / bc1``, ``1 - c`` ...), computed in Python double as
there. The element-wise math itself lives in csrc/include/<name>_math.h.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import ModuleType
from typing import Any, cast

import torch
from torch import Tensor

from lightning_optim.ops.coalesce import coalesced

SUPPORTED_PARAMS = (torch.float32, torch.bfloat16, torch.float16)


def launch(ext: ModuleType, name: str, **kwargs: Any) -> Any:
    """Run the binding ``name``: directly in eager mode, as the custom op ``torch.ops.lightning_optim.<name>``
    while torch.compile traces (one graph node instead of a graph break). Both run the same binding;
    the eager route skips the dispatcher, whose boxing of thousands of tensors costs more than it brings."""
    if torch.compiler.is_compiling():
        return getattr(torch.ops.lightning_optim, name)(**kwargs)
    return getattr(ext, name)(**kwargs)


def supports(batch: Any, ext: ModuleType) -> bool:
    """The kernels run fp32 math and state over fp32/bf16/fp16 params, dense and contiguous.

    (A bucket shares one param dtype and compute dtype; states are made like their params.)
    """
    if batch.compute_dtype != torch.float32 or batch.params[0].dtype not in SUPPORTED_PARAMS:
        return False
    if torch.compiler.is_compiling():  # read from the traced strides, guarded by dynamo: no check left at run time
        return all(t.is_contiguous() for t in (*batch.params, *batch.raw_grads))
    return batch.contiguous or ext.all_contiguous(batch.params, batch.raw_grads)


def _comps(batch: Any) -> list[Tensor]:
    return batch.state("kahan_comp") if "kahan_comp" in batch.states[0] else []


def decay_coefficient(lr: float, wd: float, max_lr: float = 0.0) -> float:
    """The coefficient ``c`` of a decoupled decay ``p <- p - c p``: ``wd * lr`` (torch's AdamW), or
    ``wd * lr / max_lr`` (fully decoupled, ``max_lr > 0``); 0 without decay. One formula for the eager
    step and the compiled ops, which work it out from a tensor lr at run time."""
    if wd == 0:
        return 0.0
    return wd * lr / max_lr if max_lr > 0 else wd * lr


def _decay(decay: float) -> tuple[float, float]:
    return 1 - decay, -decay  # keep, neg_decay: torch's p * (1 - c) and p * (-c)


def _eager_decay(lr: float | Tensor, decay_rule: tuple[float, float]) -> tuple[float, float]:
    """``_decay`` of an eager step: its lr is a float (a tensor lr only reaches the compiled ops)."""
    return _decay(decay_coefficient(cast(float, lr), *decay_rule))


def _lr_tensor(lr: float | Tensor) -> Tensor:
    """The lr as the one-element tensor the compiled ops take: a tensor lr as it is (its value is read when
    the op runs, so an LR scheduler's ``fill_`` needs no recompile), a float exactly (float64, 0-dim)."""
    return lr if isinstance(lr, Tensor) else torch.tensor(lr, dtype=torch.float64)


def _params(batch: Any) -> list[Tensor]:
    batch.mark_params_changed()
    return batch.params


def adam(ext: ModuleType) -> Callable[..., None]:
    def run(batch: Any, apply: bool, *, lr: float | Tensor, beta1: float, beta2: float, eps: float, l2: float,
            bc1: float, bc2: float, decay_rule: tuple[float, float], amsgrad: bool, count: int | None = None,
            frozen: bool = False) -> None:
        """``count``: the step whose bias corrections ``bc1``/``bc2`` are (``1 - beta ** count``), if
        they are: a compiled step then hands the op the count instead of the corrections.
        ``decay_rule``: ``(wd, max_lr)`` of :func:`decay_coefficient`. ``lr`` is a tensor only while compiling.
        ``frozen`` (with ``beta1 = 0, beta2 = 1``, ``apply``, no amsgrad): the grads are the final momenta and
        the variance is frozen: ``ext.adam_frozen`` reads both and writes only the params."""
        if frozen and apply and not amsgrad and beta1 == 0.0 and beta2 == 1.0 and not torch.compiler.is_compiling():
            keep, neg = _eager_decay(lr, decay_rule)
            ext.adam_frozen(params=_params(batch), momenta=batch.raw_grads, exp_avg_sqs=batch.state("exp_avg_sq"),
                            kahan_comps=_comps(batch), step=-lr / bc1, sqrt_bc2=math.sqrt(bc2), eps=eps, keep=keep,
                            neg_decay=neg)
            return
        if count is not None and torch.compiler.is_compiling():
            torch.ops.lightning_optim.adam_at_step(
                params=_params(batch), grads=batch.raw_grads, exp_avgs=batch.state("exp_avg"),
                exp_avg_sqs=batch.state("exp_avg_sq"),
                max_exp_avg_sqs=batch.state("max_exp_avg_sq") if amsgrad else [], kahan_comps=_comps(batch),
                param_copies=batch.take_copies() if apply else [], w1=1 - beta1, beta1=beta1, beta2=beta2,
                c2=1 - beta2, lr=_lr_tensor(lr), count=count, eps=eps, l2=l2, wd=decay_rule[0],
                max_lr=decay_rule[1], apply=apply)
            return
        keep, neg = _eager_decay(lr, decay_rule)
        lists = coalesced(batch.run_cache, dict(
            params=_params(batch), grads=batch.raw_grads, exp_avgs=batch.state("exp_avg"),
            exp_avg_sqs=batch.state("exp_avg_sq"), max_exp_avg_sqs=batch.state("max_exp_avg_sq") if amsgrad else [],
            kahan_comps=_comps(batch), param_copies=batch.take_copies() if apply else []), ext=ext)
        launch(ext, "adam", **lists, w1=1 - beta1, beta2=beta2, c2=1 - beta2, step=-lr / bc1,
               sqrt_bc2=math.sqrt(bc2), eps=eps, l2=l2, keep=keep, neg_decay=neg, apply=apply)
    return run


def sgd(ext: ModuleType) -> Callable[..., None]:
    def run(batch: Any, apply: bool, *, lr: float | Tensor, momentum: float, dampening: float, nesterov: bool,
            l2_pre: float, l2_post: float, decay_rule: tuple[float, float]) -> None:
        bufs = batch.state("momentum_buffer") if momentum != 0 else []
        common = dict(params=_params(batch), grads=batch.raw_grads, momentum_buffers=bufs, kahan_comps=_comps(batch),
                      momentum=momentum, damp_keep=1 - dampening, l2_pre=l2_pre, l2_post=l2_post,
                      first=batch.step == 1, nesterov=nesterov, apply=apply)
        if torch.compiler.is_compiling():
            torch.ops.lightning_optim.sgd_at_lr(**common, lr=_lr_tensor(lr), wd=decay_rule[0], max_lr=decay_rule[1])
            return
        keep, neg = _eager_decay(lr, decay_rule)
        lists = coalesced(batch.run_cache, {k: common.pop(k) for k in ("params", "grads", "momentum_buffers",
                                                                        "kahan_comps")}, ext=ext)
        ext.sgd(**lists, **common, neg_lr=-lr, keep=keep, neg_decay=neg)
    return run


def lion(ext: ModuleType) -> Callable[..., None]:
    def run(batch: Any, apply: bool, *, lr: float | Tensor, beta1: float, beta2: float,
            decay_rule: tuple[float, float]) -> None:
        common = dict(params=_params(batch), grads=batch.raw_grads, exp_avgs=batch.state("exp_avg"),
                      kahan_comps=_comps(batch), w1=1 - beta1, w2=1 - beta2, apply=apply)
        if torch.compiler.is_compiling():
            torch.ops.lightning_optim.lion_at_lr(**common, lr=_lr_tensor(lr), wd=decay_rule[0], max_lr=decay_rule[1])
            return
        keep, neg = _eager_decay(lr, decay_rule)
        lists = coalesced(batch.run_cache, {k: common.pop(k) for k in ("params", "grads", "exp_avgs", "kahan_comps")},
                          ext=ext)
        ext.lion(**lists, **common, neg_lr=-lr, keep=keep, neg_decay=neg)
    return run


def adan(ext: ModuleType) -> Callable[..., None]:
    def run(batch: Any, apply: bool, *, beta1: float, beta2: float, beta3: float, eps: float, step_size: float,
            decay: float) -> None:
        keep, neg = _decay(decay)
        t = batch.step
        bc1, bc2, bc3 = 1 - beta1**t, 1 - beta2**t, 1 - beta3**t
        launch(ext, "adan", params=_params(batch), grads=batch.raw_grads, exp_avgs=batch.state("exp_avg"),
               exp_avg_diffs=batch.state("exp_avg_diff"), exp_avg_sqs=batch.state("exp_avg_sq"),
               prev_grads=batch.state("prev_grad"), kahan_comps=_comps(batch), w1=1 - beta1, w2=1 - beta2,
               beta2=beta2, beta3=beta3, c3=1 - beta3, bc1=bc1, n_coef=beta2 / bc2,
               sqrt_bc3=math.sqrt(bc3), eps=eps, step=step_size, first=t == 1, keep=keep, neg_decay=neg,
               apply=apply)
    return run


class Lamb:
    """LAMB's two phases; the trust ratios in between stay with the optimizer."""

    def __init__(self, ext: ModuleType) -> None:
        self.ext = ext

    def moments(self, batch: Any, *, clip_div: float, l2: float, beta1: float, m_coef: float, beta2: float,
                bc1: float, bc2: float, eps: float, wd: float, eps_inside_sqrt: bool, norms: bool) -> Tensor:
        """Update the moments; with ``norms`` return the per-tensor (|p|, |u|) in fp32."""
        sums = launch(self.ext, "lamb_moments", params=batch.params, grads=batch.raw_grads,
                      exp_avgs=batch.state("exp_avg"), exp_avg_sqs=batch.state("exp_avg_sq"),
                      clip_div=clip_div, l2=l2, beta1=beta1, m_coef=m_coef, beta2=beta2,
                      c2=1 - beta2, bc1=bc1, bc2=bc2, eps=eps, wd=wd,
                      eps_inside_sqrt=eps_inside_sqrt, norms=norms)
        return sums.sqrt().float()

    def apply(self, batch: Any, scales: Tensor, *, bc1: float, bc2: float, eps: float, wd: float,
              eps_inside_sqrt: bool) -> None:
        """``p <- p + scales[i] * u`` with ``u`` recomputed from the updated moments."""
        launch(self.ext, "lamb_apply", params=_params(batch), exp_avgs=batch.state("exp_avg"),
               exp_avg_sqs=batch.state("exp_avg_sq"), kahan_comps=_comps(batch),
               scales=scales.float().contiguous(), bc1=bc1, bc2=bc2, eps=eps, wd=wd,
               eps_inside_sqrt=eps_inside_sqrt)


class Lars:
    """LARS: per-tensor norms, then the clipped, momentum-averaged step with per-tensor scales."""

    def __init__(self, ext: ModuleType) -> None:
        self.ext = ext

    def norms(self, batch: Any) -> Tensor:
        """Per-tensor (|p|, |g|) in fp32."""
        return launch(self.ext, "lars_norms", params=batch.params, grads=batch.raw_grads).sqrt().float()

    def step(self, batch: Any, apply: bool, scales: Tensor | None, *, weight_decay: float, grad_clip: float | None,
             momentum: float) -> None:
        clip = math.inf if grad_clip is None else grad_clip
        bufs = batch.state("momentum_buffer") if momentum != 0 else []
        launch(self.ext, "lars", params=_params(batch), grads=batch.raw_grads, momentum_buffers=bufs,
               kahan_comps=_comps(batch),
               scales=None if scales is None else scales.float().contiguous(), wd=weight_decay,
               lo_clip=-clip, hi_clip=clip, momentum=momentum, first=batch.step == 1, apply=apply)


class StableAdamW:
    """StableAdamW: moments and the per-tensor RMS in one pass, then the clipped-lr step.

    The clipped lr of each tensor, ``lr_t = lr / max(1, sqrt(mean(g^2 / max(v_hat, eps^2))))``, its step
    size ``-lr_t / bc1`` and decay are worked out in float64 tensor ops on the params' device (the same
    double arithmetic as Python floats, ``max`` included: a NaN mean gives ``lr``), so nothing is read
    back to the host: no sync on a GPU, no data-dependent graph break under torch.compile."""

    def __init__(self, ext: ModuleType) -> None:
        self.ext = ext

    def step(self, batch: Any, apply: bool, *, lr: float, beta1: float, beta2: float, bc1: float, bc2: float,
             eps: float, decay_rule: tuple[float, float]) -> None:
        sums = launch(self.ext, "stable_moments", params=batch.params, grads=batch.raw_grads,
                      exp_avgs=batch.state("exp_avg"), exp_avg_sqs=batch.state("exp_avg_sq"), w1=1 - beta1,
                      beta2=beta2, c2=1 - beta2, bc2=bc2, eps_sq=eps * eps, rms=apply)
        if not apply:
            return
        numels = torch.tensor([p.numel() for p in batch.params], dtype=torch.float64, device=sums.device)
        rms = torch.sqrt(sums[:, 0] / numels)
        lrs = lr / torch.where(rms > 1.0, rms, 1.0)
        wd, max_lr = decay_rule
        decays = (wd * lrs / max_lr if max_lr > 0 else wd * lrs) if wd != 0 else torch.zeros_like(lrs)
        device = batch.params[0].device
        launch(self.ext, "stable_apply", params=_params(batch), exp_avgs=batch.state("exp_avg"),
               exp_avg_sqs=batch.state("exp_avg_sq"), kahan_comps=_comps(batch),
               scales=(-lrs / bc1).to(device, torch.float32), keeps=(1 - decays).to(device, torch.float32),
               neg_decays=(-decays).to(device, torch.float32), bc2=bc2, eps=eps)


# name -> factory(extension module) -> kernel object
OPTIMIZER_KERNELS: dict[str, Callable[[ModuleType], Any]] = {
    "adam": adam,
    "sgd": sgd,
    "lion": lion,
    "adan": adan,
    "lamb": Lamb,
    "lars": Lars,
    "stableadamw": StableAdamW,
}

# name -> attribute of the extension module (flat-buffer kernels, no Batch)
RAW_KERNELS = ("onebit_unpack_table", "onebit_seg_sumsq", "onebit_momentum_sumsq",
               "onebit_seg_compress", "onebit_seg_unpack", "onebit_server_mean")
