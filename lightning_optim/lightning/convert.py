"""The conversion the 1-bit strategies use, under its Lightning adapter name; it lives, framework-free, in
:mod:`lightning_optim.onebit.convert` (Accelerate's ``enable_onebit`` uses it too)."""

from lightning_optim.onebit.convert import accepted_sources, retarget_schedulers, to_onebit

__all__ = ["to_onebit", "accepted_sources", "retarget_schedulers"]
