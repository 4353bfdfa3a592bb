r"""DDP comm hooks that compress every bucket with error feedback: ``"topk"``, ``"randomk"``, ``"sign_sgd"``.

For each bucket, on every rank :math:`r`, each param's local gradient :math:`g` with this rank's
residual :math:`e` of that param (zeros at first):

.. math::
    c = g + e, \qquad s_r = C(c), \qquad e \leftarrow c - s_r, \qquad
    \text{grad} \leftarrow \tfrac1W \textstyle\sum_r s_r \quad (\text{the same on every rank})

with :math:`C` from :mod:`lightning_optim.comm.compressors`, per param tensor of :math:`d` elements:

* ``"topk"``: the :math:`k = \max(1, \lfloor \text{ratio} \cdot d \rfloor)` largest :math:`|c_i|`;
  values and int32 indices are all-gathered, :math:`(W-1) \cdot k \cdot (4 + 4)` bytes per fp32 param;
* ``"randomk"``: :math:`k` positions drawn from a generator seeded ``seed``; with ``shared_indices``
  (default) every rank draws the same positions and only the values are all-reduced (ring bytes of
  :math:`k` fp32), else each rank draws its own (``seed + rank``) and values + indices are all-gathered;
* ``"sign_sgd"``: EF-SignSGD's scaled sign :math:`\frac{\|c\|_1}{d}\operatorname{sign}(c)`, one bit per
  element and one fp32 scale per param, all-gathered; ``majority_vote=True``: signSGD's vote
  :math:`\operatorname{sign}(\sum_r \operatorname{sign}(c_r))` (not averaged; the paper has no error
  feedback: pass ``error_feedback=False`` for it).

Each param is compressed on its own (``k`` and the sign scale per param, EF-SignSGD's layer-wise
scale), in the order of the model's params whatever DDP's order inside the bucket, and the residual
is kept per param name: the result then does not depend on DDP's bucket layout, which changes after
the first iteration of every process (``_bucket.py``). Random-k draws in the order DDP calls the
buckets. One collective per bucket (the compressor's exchange of all its params); the first call
with a new layout adds the compressors' bounded agreement (a small all-gather, counted as control
bytes), so ranks configured differently raise on every rank instead of hanging.

The collectives are synchronous and each is bounded by ``collective_timeout()``; the hook returns a
completed future. Bytes go to ``state.stats`` (``comm_stats()`` by default) as the compressors count
them. ``state_dict()`` holds this rank's residuals (and random-k's generator): per rank.
"""
# no ``from __future__ import annotations``: DDP checks the hook's return annotation at runtime
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from torch import Tensor

from lightning_optim.optim.validation import check_flag

from ..compressors import ErrorFeedback, LocalCompressor, RandomK, ScaledSign, TopK
from ..stats import CommStats
from ._bucket import HookState, done

__all__ = ["CompressionHookState", "TopKHookState", "RandomKHookState", "SignSGDHookState", "compression_hook"]


class CompressionHookState(HookState):
    """A local compressor with per-param, per-rank residuals (see the module docstring)."""

    def __init__(self, compressor: LocalCompressor, *, error_feedback: bool = True, group: Any = None,
                 stats: CommStats | None = None) -> None:
        super().__init__(group, stats)
        if not isinstance(compressor, LocalCompressor):
            raise TypeError(f"compressor must be a lightning_optim.comm.compressors.LocalCompressor, got "
                            f"{type(compressor).__name__}")
        self.compressor = compressor
        self.error_feedback = check_flag("error_feedback", error_feedback)
        self.feedback = ErrorFeedback()  # dtype fixed at the first bucket: fp64 for fp64 grads, else fp32
        self.buckets_compressed = 0

    def residuals(self, keys: Sequence[str], tensors: Sequence[Tensor]) -> list[Tensor]:
        if self.feedback.dtype is None:
            self.feedback.dtype = torch.float64 if tensors[0].dtype == torch.float64 else torch.float32
        return self.feedback.residuals(keys, tensors)

    def state_dict(self) -> dict[str, Any]:
        """This rank's residuals by param name and the compressor's random state."""
        return {**self._stamp(), "residuals": self.feedback.state_dict()["residuals"],
                "compressor": self.compressor.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        state = self._check_stamp(state)
        residuals = state.get("residuals")
        self.feedback.load_state_dict({"residuals": residuals})  # checks the tensors first
        self.compressor.load_state_dict(state.get("compressor", {}))
        dtypes = {e.dtype for e in cast(Mapping[str, Tensor], residuals).values()}  # checked just above
        self.feedback.dtype = dtypes.pop() if len(dtypes) == 1 else None


class TopKHookState(CompressionHookState):
    """``"topk"``: keep the ``ratio`` largest-magnitude elements of each param's gradient, ``ratio`` in (0, 1]."""

    hook_name = "topk"

    def __init__(self, ratio: float = 0.01, *, error_feedback: bool = True, group: Any = None,
                 stats: CommStats | None = None) -> None:
        compressor = TopK(ratio=ratio)
        super().__init__(compressor, error_feedback=error_feedback, group=group, stats=stats)
        self.ratio = compressor.ratio


class RandomKHookState(CompressionHookState):
    """``"randomk"``: keep ``ratio`` (in (0, 1]) of each param's elements at random positions."""

    hook_name = "randomk"

    def __init__(self, ratio: float = 0.01, *, seed: int = 0, shared_indices: bool = True,
                 error_feedback: bool = True, group: Any = None, stats: CommStats | None = None) -> None:
        compressor = RandomK(ratio=ratio, seed=seed, shared_indices=shared_indices)
        super().__init__(compressor, error_feedback=error_feedback, group=group, stats=stats)
        self.ratio, self.seed, self.shared_indices = compressor.ratio, seed, shared_indices


class SignSGDHookState(CompressionHookState):
    """``"sign_sgd"``: EF-SignSGD's scaled sign, or signSGD's majority vote (``majority_vote=True``)."""

    hook_name = "sign_sgd"

    def __init__(self, *, majority_vote: bool = False, error_feedback: bool = True, group: Any = None,
                 stats: CommStats | None = None) -> None:
        super().__init__(ScaledSign(majority_vote=majority_vote), error_feedback=error_feedback, group=group,
                         stats=stats)
        self.majority_vote = majority_vote


def compression_hook(state: CompressionHookState, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket's gradients compressed with error feedback and averaged over ranks."""
    names = state.names_of(bucket)
    grads = bucket.gradients()  # views into bucket.buffer(), one per param
    position = state.attached_names().position
    order = sorted(range(len(names)), key=lambda i: position[names[i]])
    tensors = [grads[i] for i in order]
    keys = [names[i] for i in order]
    residuals = state.residuals(keys, tensors) if state.error_feedback else None
    out = state.compressor.reduce(tensors, residuals, group=state.group, average=True, stats=state.stats)
    for grad, aggregate in zip(tensors, out):
        grad.copy_(aggregate)
    state.buckets_compressed += 1
    return done(bucket.buffer())
