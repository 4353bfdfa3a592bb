r"""``gradient_clip_val`` (norm) in the 1-bit strategies' compression stage: one norm for all ranks.

There each rank holds its local gradient :math:`g_r` (the optimizer averages afterwards,
compressed); clipping each by its own norm would scale the ranks' contributions differently and
log a different norm per rank. Instead every rank scales by the same :math:`\min(1, c / N)` with
:math:`N = \sqrt{\mathrm{mean}_r \lVert g_r \rVert^2}` (:func:`lightning_optim.comm.dense.agreed_norm`,
one 4-byte all-reduce), which is at least the averaged gradient's norm: the clip is at least DDP's.
In warmup DDP has averaged the gradients, and in ZeroOneAdam's local stage each rank updates with its
own gradient: there the precision plugin's own clip runs (on the fp32 masters with
``MasterWeightsPrecision``: ``main_params``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_optim.comm.dense import agreed_norm
from lightning_optim.lightning._bases import ParallelBase

if TYPE_CHECKING:
    from lightning_optim.onebit import OnebitOptimizer

__all__ = ["_AgreedClipMixin"]


class _AgreedClipMixin(ParallelBase):
    """For the 1-bit strategies; their optimizer's ``averages_local_grads`` tells the coming step's kind."""

    last_clip_norm: float | None = None  # the norm the last compression-stage clip used (equal on every rank)

    if TYPE_CHECKING:  # each 1-bit strategy's own

        @property
        def onebit_optimizer(self) -> OnebitOptimizer | None: ...

    def _agree_on_clipping(self) -> None:
        """Wrap this strategy's precision plugin's ``clip_grad_by_norm`` (once; undone by ``teardown``)."""
        plugin = self.precision_plugin
        current = vars(plugin).get("clip_grad_by_norm")
        if current is not None and getattr(current, "_agreed_clip_of", None) is self:
            return
        if current is not None and hasattr(current, "_agreed_clip_of"):  # another strategy's, not torn down
            _unwrap(plugin)
        own = plugin.clip_grad_by_norm

        def clip_grad_by_norm(optimizer: Any, clip_val: float) -> None:
            onebit = self.onebit_optimizer
            if onebit is None or not onebit.averages_local_grads:
                return own(optimizer, clip_val)
            grads, local_norm = self._clip_norm_input([p.grad for p in plugin.main_params(optimizer)
                                                       if p.grad is not None])
            norm = agreed_norm(local_norm)
            coef = torch.clamp(clip_val / (norm + 1e-6), max=1.0)  # clip_grads_with_norm_'s rule
            for g in grads:  # the tensors _clip_norm_input gives (FSDP: the local shards)
                g.mul_(coef.to(g.device))
            self.last_clip_norm = float(norm)
            return None

        # marks on the wrapper (what teardown undoes), and the wrapper set on this plugin instance only
        clip_grad_by_norm._agreed_clip_of = self  # type: ignore[attr-defined]
        clip_grad_by_norm._agreed_clip_before = vars(plugin).get("clip_grad_by_norm")  # type: ignore[attr-defined]
        plugin.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]

    def _clip_norm_input(self, grads: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The tensors to scale and this rank's norm for ``agreed_norm`` (DDP: its gradients and their norm)."""
        return grads, nn.utils.get_total_norm(grads) if grads else torch.zeros(())

    def teardown(self) -> None:
        """Give the precision plugin its own ``clip_grad_by_norm`` back: the user may reuse the plugin
        with another strategy (ours would keep this strategy and its optimizer alive and in charge)."""
        plugin = getattr(self, "precision_plugin", None)
        current = vars(plugin).get("clip_grad_by_norm") if plugin is not None else None
        if current is not None and getattr(current, "_agreed_clip_of", None) is self:
            _unwrap(plugin)
        super().teardown()


def _unwrap(plugin: Any) -> None:
    before = vars(plugin)["clip_grad_by_norm"]._agreed_clip_before
    if before is None:
        del plugin.clip_grad_by_norm
    else:
        plugin.clip_grad_by_norm = before
