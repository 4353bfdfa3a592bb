"""Independent reference implementations of the project's optimizers, written from the papers'
update equations (and the named library's documented/observed conventions), one plain for-loop
per parameter tensor. They never import ``lightning_optim``.

Interface (every class):
    ref = Ref<Name>(params: list[Tensor], **hyperparams)   # plain tensors, updated in place
    ref.step(grads: list[Tensor | None]) -> None            # grads passed explicitly; None = skip
    ref.lr = new_lr                                          # scheduler tests: lr may change per step
State lives on the instance (``ref.state`` etc.); the math runs in the params' dtype.
See each module's docstring for equations, sources and convention choices.
"""

from .adam import RefAdam, RefAdamW
from .adan import RefAdan
from .lamb import RefLAMB
from .lars import RefLARS
from .lion import RefLion
from .radam_lookahead import RefLookahead, RefRAdam, RefRanger
from .signsgd import RefSignSGD
from .sparsified_sgd import RefSparsifiedSGD
from .stableadamw import RefStableAdamW

__all__ = [
    "RefAdam",
    "RefAdamW",
    "RefAdan",
    "RefLAMB",
    "RefLARS",
    "RefLion",
    "RefLookahead",
    "RefRAdam",
    "RefRanger",
    "RefSignSGD",
    "RefSparsifiedSGD",
    "RefStableAdamW",
]
