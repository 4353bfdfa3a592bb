"""The old module path of :class:`~lightning_optim.onebit.ZeroOneAdam`: importing it warns; the class lives
in :mod:`lightning_optim.onebit.zero_one_adam`."""

import warnings

from lightning_optim.onebit.zero_one_adam import ZeroOneAdam

__all__ = ["ZeroOneAdam"]

warnings.warn("lightning_optim.onebit.zoadam is deprecated: import ZeroOneAdam from lightning_optim.onebit (or "
              "lightning_optim.onebit.zero_one_adam)", DeprecationWarning, stacklevel=2)
