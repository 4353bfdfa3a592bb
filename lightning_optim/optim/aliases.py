"""The seeds' optimizer names with their exact constructor signatures.

Each alias is the same optimizer as its lightning-optim counterpart; only the argument names and
defaults follow the seed (DeepSpeed FusedAdam / DeepSpeedCPUAdam, ColossalAI FusedSGD). The
project's own flags (``foreach``, ``kahan_sum``, ``decouple_lr``...) are accepted as extra
keyword-only arguments. The fastest available path is taken (compiled kernels arrive with the
``ops`` package).
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_optim.optim.adam import Adam
from lightning_optim.optim.base import ParamsT
from lightning_optim.optim.sgd import SGD
from lightning_optim.optim.validation import check_flag

__all__ = ["CPUAdam", "FusedAdam", "FusedSGD"]


class FusedAdam(Adam):
    """DeepSpeed/apex ``FusedAdam``: AdamW by default (``adam_w_mode=True``); amsgrad supported.

    ``set_grad_none`` picks ``zero_grad``'s default (True: free the gradients).
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
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
            adam_w_mode=adam_w_mode,
            bias_correction=bias_correction,
            **flags,
        )

    def zero_grad(self, set_to_none: bool | None = None, param: torch.Tensor | None = None) -> None:
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none, param=param)


class CPUAdam(Adam):
    """DeepSpeed ``DeepSpeedCPUAdam``: AdamW by default; fp32 states for fp16/bf16 params by default.

    ``fp32_optimizer_states`` (DeepSpeed's name) and ``fp32_state`` (ours) are one setting: give
    either (default True); both with different values is a ``ValueError``.
    """

    def __init__(
        self,
        model_params: ParamsT,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool | None = None,
        **flags: Any,
    ) -> None:
        ours = flags.pop("fp32_state", None)
        if fp32_optimizer_states is not None:
            check_flag("fp32_optimizer_states", fp32_optimizer_states)
        if ours is not None:
            check_flag("fp32_state", ours)
        if ours is not None and fp32_optimizer_states is not None and ours != fp32_optimizer_states:
            raise ValueError(f"fp32_state={ours} contradicts fp32_optimizer_states={fp32_optimizer_states}: "
                             "they are one setting, give one of them")
        fp32 = next((v for v in (fp32_optimizer_states, ours) if v is not None), True)
        super().__init__(
            model_params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            adam_w_mode=check_flag("adamw_mode", adamw_mode),
            bias_correction=bias_correction,
            fp32_state=fp32,
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
