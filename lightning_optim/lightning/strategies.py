"""Lightning strategies for the 1-bit optimizers and the DDP comm hooks (``lightning.pytorch``).

    import lightning_optim                      # registers the names below
    trainer = Trainer(accelerator="cpu", devices=2, strategy="onebit_adam")
    trainer = Trainer(devices=2, strategy=OnebitAdamStrategy(freeze_step=1000, timeout=120))

=================  ========================  =================================================
name               class                     converts (``configure_optimizers`` returns ...)
=================  ========================  =================================================
``onebit_adam``    ``OnebitAdamStrategy``    torch/lightning_optim Adam, AdamW (-> OnebitAdam)
``zero_one_adam``  ``ZeroOneAdamStrategy``   the same (-> ZeroOneAdam)
``onebit_lamb``    ``OnebitLambStrategy``    lightning_optim Lamb, FusedLamb (-> OnebitLamb)
=================  ========================  =================================================

Each is Lightning's ``DDPStrategy`` (gloo on CPU, NCCL on GPU, chosen by the accelerator) whose
gradient allreduce is switched off exactly in the steps where the 1-bit optimizer communicates
by itself. The optimizer returned by ``configure_optimizers`` is replaced by its 1-bit variant
with the same param groups and hyper-parameters (``lightning_optim.onebit.convert``); a 1-bit
optimizer is used as is. The 1-bit arguments are strategy arguments (``None``: the optimizer's
default); ``timeout`` (seconds, default 300) bounds every collective, so a dead or hung rank
stops the others with an error instead of a hang; ``telemetry`` adds :class:`CommTelemetry`.
Other keyword arguments go to ``DDPStrategy`` (``find_unused_parameters``, ``static_graph``,
``start_method``...), except the comm-hook ones, which the strategy owns.

Checkpoints: rank 0 writes the checkpoint; every other rank writes its own 1-bit state (error
buffers; between ZeroOneAdam synchronisations also its optimizer state and params) to
``<checkpoint>.rank<r>.pt`` and reads it back on resume, so training continues bitwise. On
another world size the error buffers restart at zero with one warning. See docs/guides/lightning.md.

The comm-hook strategies take any (local) optimizer; each is ``DDPStrategy`` with one hook of
:mod:`lightning_optim.comm.ddp_hooks` registered on every device (CPU too), its per-rank hook state
in the same ``<checkpoint>.rank<r>.pt`` files, and the same ``timeout``/``telemetry`` arguments:

=================  ==========================  ==================================================
``powersgd``       ``PowerSGDStrategy``        torch's ``powerSGD_hook`` (rank, start iteration)
``topk``           ``TopKStrategy``            top-k per param with error feedback
``randomk``        ``RandomKStrategy``         random-k per param with error feedback
``sign_sgd``       ``SignSGDStrategy``         EF-SignSGD scaled signs, or majority vote
``fp16_compress``  ``FP16CompressStrategy``    torch's ``fp16_compress_hook`` (half of fp32 DDP's bytes)
``decentralized``  ``DecentralizedStrategy``   local gradients, gossip of the params after each step
=================  ==========================  ==================================================

The DiLoCo strategies wrap the (local) optimizer in :class:`lightning_optim.DiLoCo` over the ``"local"``
hook (no gradient all-reduce); each rank's params and optimizer state go into its own checkpoint file:

====================  ============================  ===============================================
``diloco``            ``DiLoCoStrategy``            outer Nesterov step every ``sync_every`` steps
``streaming_diloco``  ``StreamingDiLoCoStrategy``   the same in fragments, overlapped (4, True)
====================  ============================  ===============================================

See docs/guides/low_communication.md.

The fault-tolerant strategies run one process per replica group on torchft (``lightning_optim.fault_tolerance``),
each replica its own launch with its own ``replica_id`` and the same Lighthouse (``lighthouse=`` or
``TORCHFT_LIGHTHOUSE``; ``"local"`` starts one in the replica): a replica that dies costs the others one exchange:

=============  ======================  ==========================================================
``ft_diloco``  ``FTDiLoCoStrategy``    DiLoCo; every synchronisation a quorum of the replicas alive
``ft_ddp``     ``FTDDPStrategy``       gradients averaged over the replicas alive at every step
=============  ======================  ==========================================================

See docs/guides/fault_tolerance.md.
"""

from __future__ import annotations

from lightning.pytorch import Callback
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

from lightning_optim.catalogue import STRATEGIES as _CATALOGUE
from lightning_optim.lightning import registry as _registry
from lightning_optim.lightning._comm_hook_strategies import _ConsensusTelemetryMixin
from lightning_optim.lightning._flavour import build
from lightning_optim.lightning.callbacks import CommTelemetry


class ConsensusTelemetry(_ConsensusTelemetryMixin, Callback):
    __doc__ = _ConsensusTelemetryMixin.__doc__


# One class per catalogue strategy: OnebitAdamStrategy, ..., PowerSGDStrategy, ... (lightning_optim.lightning._flavour).
_BASES: dict[str, type] = {"DDPStrategy": DDPStrategy, "ModelParallelStrategy": ModelParallelStrategy}
_CLASSES = build(_BASES, CommTelemetry, ConsensusTelemetry, __name__)
globals().update(_CLASSES)
STRATEGIES = {name: _CLASSES[entry.export] for name, entry in _CATALOGUE.items()}  # the catalogue's names
__all__ = [*_CLASSES, "ConsensusTelemetry", "STRATEGIES"]  # noqa: PLE0604 - the classes are built from the catalogue

# Importing this module imported lightning.pytorch: make sure the names are registered there.
_registry.register("lightning.pytorch")
