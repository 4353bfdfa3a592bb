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


SPECS: list[Spec] = [
    Spec("Adam", dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    Spec("AdamW", dict(lr=1e-2, weight_decay=0.1)),
    Spec("SGD", dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.1)),
    Spec("FusedAdam", dict(lr=1e-2, weight_decay=0.1)),
    Spec("CPUAdam", dict(lr=1e-2, weight_decay=0.1)),
    Spec("FusedSGD", dict(lr=1e-2, momentum=0.9, wd_after_momentum=True, weight_decay=0.1)),
    Spec("Lamb", dict(lr=1e-2, weight_decay=0.1)),
    Spec("FusedLamb", dict(lr=1e-2, weight_decay=0.1)),
    Spec("Lars", dict(lr=1.0, momentum=0.9, weight_decay=1e-3), kahan_lr=1e-1),
    Spec("Lion", dict(lr=1e-3, weight_decay=0.1)),
    Spec("Adan", dict(lr=1e-2, weight_decay=0.02)),
    Spec("RAdam", dict(lr=1e-2, weight_decay=0.1)),
    Spec("Ranger", dict(lr=1e-2, weight_decay=0.1)),
    Spec("StableAdamW", dict(lr=1e-2, weight_decay=0.1)),
    Spec("SignSGD", dict(lr=1e-3, momentum=0.9, weight_decay=0.1)),
    # top-k selection: the random modes need a freshly seeded generator per instance
    Spec("SparsifiedSGD", dict(lr=1e-1, sparse_grad_size=4, mode="topk", weight_decay=0.01)),
]
