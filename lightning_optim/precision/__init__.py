"""Mixed precision without a framework: loss scaling, fp32 master weights, mlbench's FP16Optimizer.

* :class:`DynamicLossScaler`: scale/unscale, inf/NaN check agreed by every rank, back-off and growth.
* :class:`MasterWeights`: fp32 masters of a 16-bit model, swapped into any optimizer.
* :class:`FP16Optimizer`: mlbench-core's wrapper (flat fp32 master, averaging over ranks).

The Lightning plugins built on them live in :mod:`lightning_optim.lightning`.
"""
from lightning_optim.precision.fp16_optimizer import FP16Optimizer
from lightning_optim.precision.loss_scaler import DynamicLossScaler, LossScaleUnderflow, found_non_finite
from lightning_optim.precision.master_weights import MasterWeights

__all__ = ["DynamicLossScaler", "FP16Optimizer", "LossScaleUnderflow", "MasterWeights", "found_non_finite"]
