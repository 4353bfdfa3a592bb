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
from typing import Any

import torch
from torch import Tensor

SUPPORTED_PARAMS = (torch.float32, torch.bfloat16, torch.float16)


def supports(batch: Any, ext: ModuleType) -> bool:
    """The kernels run fp32 math and state over fp32/bf16/fp16 params, dense and contiguous.

    (A bucket shares one param dtype and compute dtype; states are made like their params.)
    """
    if batch.compute_dtype != torch.float32 or batch.params[0].dtype not in SUPPORTED_PARAMS:
        return False
    return ext.all_contiguous(batch.params, batch.raw_grads)


def _comps(batch: Any) -> list[Tensor]:
    return batch.state("kahan_comp") if "kahan_comp" in batch.states[0] else []


def _decay(decay: float) -> tuple[float, float]:
    return 1 - decay, -decay  # keep, neg_decay: torch's p * (1 - c) and p * (-c)


def _params(batch: Any) -> list[Tensor]:
    batch.mark_params_changed()
    return batch.params


def adam(ext: ModuleType) -> Callable[..., None]:
    def run(batch: Any, apply: bool, *, lr: float, beta1: float, beta2: float, eps: float, l2: float,
            bc1: float, bc2: float, decay: float, amsgrad: bool) -> None:
        keep, neg = _decay(decay)
        ext.adam(_params(batch), batch.raw_grads, batch.state("exp_avg"), batch.state("exp_avg_sq"),
                 batch.state("max_exp_avg_sq") if amsgrad else [], _comps(batch), [],
                 1 - beta1, beta2, 1 - beta2, -lr / bc1, math.sqrt(bc2), eps, l2, keep, neg, apply)
    return run


def sgd(ext: ModuleType) -> Callable[..., None]:
    def run(batch: Any, apply: bool, *, lr: float, momentum: float, dampening: float, nesterov: bool,
            l2_pre: float, l2_post: float, decay: float) -> None:
        keep, neg = _decay(decay)
        bufs = batch.state("momentum_buffer") if momentum != 0 else []
        ext.sgd(_params(batch), batch.raw_grads, bufs, _comps(batch), momentum, 1 - dampening, l2_pre, l2_post,
                -lr, batch.step == 1, nesterov, keep, neg, apply)
    return run


def lion(ext: ModuleType) -> Callable[..., None]:
    def run(batch: Any, apply: bool, *, lr: float, beta1: float, beta2: float, decay: float) -> None:
        keep, neg = _decay(decay)
        ext.lion(_params(batch), batch.raw_grads, batch.state("exp_avg"), _comps(batch), 1 - beta1, 1 - beta2, -lr,
                 keep, neg, apply)
    return run


def adan(ext: ModuleType) -> Callable[..., None]:
    def run(batch: Any, apply: bool, *, beta1: float, beta2: float, beta3: float, eps: float, step_size: float,
            decay: float) -> None:
        keep, neg = _decay(decay)
        t = batch.step
        bc1, bc2, bc3 = 1 - beta1**t, 1 - beta2**t, 1 - beta3**t
        ext.adan(_params(batch), batch.raw_grads, batch.state("exp_avg"), batch.state("exp_avg_diff"),
                 batch.state("exp_avg_sq"), batch.state("prev_grad"), _comps(batch), 1 - beta1, 1 - beta2, beta2,
                 beta3, 1 - beta3, bc1, beta2 / bc2, math.sqrt(bc3), eps, step_size, t == 1, keep, neg, apply)
    return run


class Lamb:
    """LAMB's two phases; the trust ratios in between stay with the optimizer."""

    def __init__(self, ext: ModuleType) -> None:
        self.ext = ext

    def moments(self, batch: Any, *, clip_div: float, l2: float, beta1: float, m_coef: float, beta2: float,
                bc1: float, bc2: float, eps: float, wd: float, eps_inside_sqrt: bool, norms: bool) -> Tensor:
        """Update the moments; with ``norms`` return the per-tensor (|p|, |u|) in fp32."""
        sums = self.ext.lamb_moments(batch.params, batch.raw_grads, batch.state("exp_avg"), batch.state("exp_avg_sq"),
                                     clip_div, l2, beta1, m_coef, beta2, 1 - beta2, bc1, bc2, eps, wd,
                                     eps_inside_sqrt, norms)
        return sums.sqrt().float()

    def apply(self, batch: Any, scales: Tensor, *, bc1: float, bc2: float, eps: float, wd: float,
              eps_inside_sqrt: bool) -> None:
        """``p <- p + scales[i] * u`` with ``u`` recomputed from the updated moments."""
        self.ext.lamb_apply(_params(batch), batch.state("exp_avg"), batch.state("exp_avg_sq"), _comps(batch),
                            scales.float().contiguous(), bc1, bc2, eps, wd, eps_inside_sqrt)


class Lars:
    """LARS: per-tensor norms, then the clipped, momentum-averaged step with per-tensor scales."""

    def __init__(self, ext: ModuleType) -> None:
        self.ext = ext

    def norms(self, batch: Any) -> Tensor:
        """Per-tensor (|p|, |g|) in fp32."""
        return self.ext.lars_norms(batch.params, batch.raw_grads).sqrt().float()

    def step(self, batch: Any, apply: bool, scales: Tensor | None, *, weight_decay: float, grad_clip: float | None,
             momentum: float) -> None:
        clip = math.inf if grad_clip is None else grad_clip
        bufs = batch.state("momentum_buffer") if momentum != 0 else []
        self.ext.lars(_params(batch), batch.raw_grads, bufs, _comps(batch),
                      None if scales is None else scales.float().contiguous(), weight_decay, -clip, clip, momentum,
                      batch.step == 1, apply)


class StableAdamW:
    """StableAdamW: moments and the per-tensor RMS in one pass, then the clipped-lr step."""

    def __init__(self, ext: ModuleType) -> None:
        self.ext = ext

    def moments(self, batch: Any, *, beta1: float, beta2: float, bc2: float, eps: float, rms: bool) -> list[float]:
        sums = self.ext.stable_moments(batch.params, batch.raw_grads, batch.state("exp_avg"), batch.state("exp_avg_sq"),
                                       1 - beta1, beta2, 1 - beta2, bc2, eps * eps, rms)
        numels = torch.tensor([p.numel() for p in batch.params], dtype=torch.float64)
        return (sums[:, 0].cpu() / numels).tolist()

    def apply(self, batch: Any, *, step_sizes: list[float], decays: list[float], bc2: float, eps: float) -> None:
        def floats(values: list[float]) -> Tensor:
            return torch.tensor(values, dtype=torch.float32, device=batch.params[0].device)

        self.ext.stable_apply(_params(batch), batch.state("exp_avg"), batch.state("exp_avg_sq"), _comps(batch),
                              floats(step_sizes), floats([1 - c for c in decays]), floats([-c for c in decays]),
                              bc2, eps)


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
RAW_KERNELS = ("onebit_compress", "onebit_pack", "onebit_unpack", "onebit_unpack_table", "onebit_seg_sumsq",
               "onebit_seg_compress", "onebit_seg_unpack", "onebit_server_mean")
