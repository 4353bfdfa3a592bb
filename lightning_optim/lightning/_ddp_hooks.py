"""DDP with the switchable allreduce comm hook, on every device: a concern of its own so the 1-bit
strategies, the precision plugins and gradient release can share it.

Lightning's ``DDPStrategy`` registers ``ddp_comm_hook`` on CUDA only (silently skipped on CPU); this
mixin registers :func:`lightning_optim.comm.register_switchable_allreduce` on the wrapped model in
any case, and before every backward (``manual_backward`` included) sets the switch to
:meth:`_grads_need_averaging` (default: always average, i.e. plain DDP).
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_optim.comm import SwitchableAllreduceState, register_switchable_allreduce
from lightning_optim.lightning._bases import DDPBase

__all__ = ["_SwitchableAllreduceMixin"]


class _SwitchableAllreduceMixin(DDPBase):
    """For ``class X(_SwitchableAllreduceMixin, DDPStrategy)``; reads ``self.model`` only."""

    _switch: SwitchableAllreduceState | None = None

    @property
    def allreduce_switch(self) -> SwitchableAllreduceState | None:
        """The ``SwitchableAllreduceState`` of DDP's comm hook (``enabled``, bucket counters)."""
        return self._switch

    def _register_ddp_hooks(self) -> None:
        self._switch = register_switchable_allreduce(self.model, group=None, enabled=True)

    def _grads_need_averaging(self) -> bool:
        """Whether the coming backward must hand averaged gradients to the optimizer."""
        return True

    def pre_backward(self, closure_loss: torch.Tensor) -> Any:
        if self._switch is not None:
            self._switch.enabled = self._grads_need_averaging()
        return super().pre_backward(closure_loss)
