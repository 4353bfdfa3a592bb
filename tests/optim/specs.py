"""One entry per optimizer for the generic, spec-driven tests (foreach, release, reload, Kahan...).

``kwargs`` are hyper-parameters that exercise the optimizer's main path; ``kahan_lr`` is an lr at
which bf16 rounding swallows most updates without compensation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import lightning_optim.optim as lo


@dataclass(frozen=True)
class Spec:
    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    kahan_lr: float = 1e-3
    accumulates: bool = True  # has a state that optimizer accumulation can fill
    releases: bool = True  # gradient release possible

    @property
    def cls(self) -> type:
        return getattr(lo, self.name)

    def __str__(self) -> str:
        return self.name


def _maybe(name: str, **spec_kwargs: Any) -> list[Spec]:
    """Specs for optimizers that other work may not have landed yet."""
    return [Spec(name, **spec_kwargs)] if hasattr(lo, name) else []


SPECS: list[Spec] = [
    Spec("Adam", dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    Spec("AdamW", dict(lr=1e-2, weight_decay=0.1)),
    Spec("SGD", dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.1)),
    Spec("FusedAdam", dict(lr=1e-2, weight_decay=0.1)),
    Spec("CPUAdam", dict(lr=1e-2, weight_decay=0.1)),
    Spec("FusedSGD", dict(lr=1e-2, momentum=0.9, wd_after_momentum=True, weight_decay=0.1)),
    *_maybe("Lamb", kwargs=dict(lr=1e-2, weight_decay=0.1)),
    *_maybe("FusedLamb", kwargs=dict(lr=1e-2, weight_decay=0.1)),
    *_maybe("Lars", kwargs=dict(lr=1.0, momentum=0.9, weight_decay=1e-3), kahan_lr=1e-1),
    *_maybe("Lion", kwargs=dict(lr=1e-3, weight_decay=0.1)),
    *_maybe("Adan", kwargs=dict(lr=1e-2, weight_decay=0.02)),
    *_maybe("RAdam", kwargs=dict(lr=1e-2, weight_decay=0.1)),
    *_maybe("Ranger", kwargs=dict(lr=1e-2, weight_decay=0.1)),
    *_maybe("StableAdamW", kwargs=dict(lr=1e-2, weight_decay=0.1)),
    *_maybe("SignSGD", kwargs=dict(lr=1e-3, momentum=0.9, weight_decay=0.1)),
]
