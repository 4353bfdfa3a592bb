"""The seeds' optimizer names, each with its seed's argument order and defaults.

Each alias is the same optimizer as its lightning-optim counterpart; the argument order and
defaults follow the seed (DeepSpeed FusedAdam / DeepSpeedCPUAdam, ColossalAI FusedSGD), the names
torch.optim's, with the seed's spellings (``adam_w_mode``, ``model_params`` ...) taken as aliases. The
project's own flags (``foreach``, ``kahan_sum``, ``decouple_lr``...) are accepted as extra
keyword-only arguments. The fastest available path is taken (compiled kernels arrive with the
``ops`` package).
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_optim.optim.adam import ADAM_W_MODE, Adam
from lightning_optim.optim.base import ParamsT
from lightning_optim.optim.sgd import SGD
from lightning_optim.optim.validation import check_flag
from lightning_optim.renames import Alias, argument_aliases

__all__ = ["CPUAdam", "FusedAdam", "FusedSGD"]


@argument_aliases(ADAM_W_MODE)
class FusedAdam(Adam):
    """DeepSpeed/apex ``FusedAdam``: AdamW by default (``decoupled_weight_decay=True``, their ``adam_w_mode``);
    amsgrad supported; the arguments in DeepSpeed's order.

    ``set_grad_none`` picks ``zero_grad``'s default (True: free the gradients).
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        decoupled_weight_decay: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
        **flags: Any,
    ) -> None:
        self.set_grad_none = check_flag("set_grad_none", set_grad_none)
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            decoupled_weight_decay=decoupled_weight_decay,
            bias_correction=bias_correction,
            **flags,
        )

    def zero_grad(self, set_to_none: bool | None = None, param: torch.Tensor | None = None) -> None:
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none, param=param)


@argument_aliases(
    Alias("model_params", "params", "DeepSpeed's DeepSpeedCPUAdam"),
    Alias("adamw_mode", "decoupled_weight_decay", "DeepSpeed's DeepSpeedCPUAdam"),
    Alias("fp32_optimizer_states", "fp32_state", "DeepSpeed's DeepSpeedCPUAdam"),
    ADAM_W_MODE,
)
class CPUAdam(Adam):
    """DeepSpeed ``DeepSpeedCPUAdam``: AdamW by default; fp32 states for fp16/bf16 params by default
    (``fp32_state=True``); the arguments in DeepSpeed's order."""

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        decoupled_weight_decay: bool = True,
        fp32_state: bool = True,
        **flags: Any,
    ) -> None:
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            decoupled_weight_decay=decoupled_weight_decay,
            bias_correction=bias_correction,
            fp32_state=fp32_state,
            **flags,
        )


class FusedSGD(SGD):
    """ColossalAI/apex ``FusedSGD`` (``lr`` is required, as there)."""

    def __init__(
        self,
        params: ParamsT,
        lr: float,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        wd_after_momentum: bool = False,
        **flags: Any,
    ) -> None:
        super().__init__(
            params, lr, momentum, dampening, weight_decay, nesterov, wd_after_momentum=wd_after_momentum, **flags
        )
