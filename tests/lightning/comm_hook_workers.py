"""Rank side of the comm-hook strategy tests: real Trainer runs inside ``run_workers`` ranks (the
environment of ``workers.py``: Lightning sees an already-launched world), on the main job's tiny model.

Per strategy: two epochs of ``RESUME_EPOCH`` steps with a checkpoint after each, then the first
epoch's checkpoint resumed for the second. The PowerSGD run records, per step, the params, the batch
and the gradients the hook produced, so the rank can replay the steps through torch's own
``powerSGD_hook`` on a plain DDP model afterwards. Then PowerSGD with several buckets well past its
start, and by name in a fit shorter than its start. Last, the refusals that need a running world.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tests.lightning.workers import DATA, MODEL, SCHEDULER, SEQ_LEN, _flat_params, _lightning_env

RESUME_EPOCH = 7
POWERSGD = dict(matrix_approximation_rank=2, start_powerSGD_iter=3)
# several buckets (torch's hook alone aborts on gloo there), well past the start: 14 compressed steps
POWERSGD_BUCKETS = dict(matrix_approximation_rank=2, start_powerSGD_iter=10)
BUCKET_CAP_MB = 0.01
BUCKET_STEPS = 24
BY_NAME_STEPS = 3  # strategy="powersgd" (start_powerSGD_iter=1000): plain DDP, with one warning
# name -> (strategy class name, strategy kwargs)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "powersgd": ("PowerSGDStrategy", POWERSGD),
    "topk": ("TopKStrategy", dict(ratio=0.01)),
    "randomk": ("RandomKStrategy", dict(ratio=0.05)),
    "sign_sgd": ("SignSGDStrategy", {}),
    "decentralized": ("DecentralizedStrategy", dict(consensus_every=2)),
    "fp16_compress": ("FP16CompressStrategy", {}),
}


def _adamw(params):
    return torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1)


def _fit(case: str, out: Path, *, max_steps: int, ckpt_in: str | None = None, checkpoint_dir: str | None = None,
         strategy: Any = None, optimizer: Any = _adamw, callbacks: list | None = None,
         gradient_clip_val: float | None = 1.0) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    import lightning_optim.lightning.strategies as strategies
    from lightning_optim.data import ByteDataModule
    from lightning_optim.model import LanguageModel

    class Recorder(pl.Callback):
        def __init__(self) -> None:
            self.rows: list[dict[str, Any]] = []
            self.replay: list[dict[str, Any]] = []  # params, batch, hook's gradients per step
            self.half: list[torch.Tensor] = []  # params after the local step (before any gossip)
            self.mixed: list[torch.Tensor] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.replay.append({"params": {k: v.clone() for k, v in pl_module.state_dict().items()},
                                "batch": batch.clone()})

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):  # before clipping
            self.replay[-1]["grads"] = [p.grad.detach().clone() for p in pl_module.parameters()]

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            strategy = trainer.strategy
            self.rows.append({"loss": float(outputs["loss"]), "step": trainer.global_step, **strategy.comm_last_step})
            self.mixed.append(_flat_params(pl_module))  # after the step (and the gossip)

    name, kwargs = CASES[case]
    pl.seed_everything(7, workers=True)
    model = LanguageModel(MODEL, SEQ_LEN, optimizer=optimizer, scheduler=SCHEDULER)
    recorder = Recorder()
    callbacks = [recorder, *(callbacks or [])]
    if checkpoint_dir:
        callbacks.append(ModelCheckpoint(dirpath=checkpoint_dir, save_top_k=-1, every_n_train_steps=RESUME_EPOCH))
    strategy = strategy if strategy is not None else getattr(strategies, name)(**kwargs, timeout=60)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=max_steps,
                         limit_train_batches=RESUME_EPOCH, limit_val_batches=0, num_sanity_val_steps=0,
                         logger=CSVLogger(str(out), name="", version=""), log_every_n_steps=1, callbacks=callbacks,
                         enable_checkpointing=bool(checkpoint_dir), enable_progress_bar=False,
                         enable_model_summary=False, gradient_clip_val=gradient_clip_val)

    def after_local_step(opt, args, kwargs):  # torch's step post-hook: the gossip comes after it
        recorder.half.append(_flat_params(model))

    if case == "decentralized":
        model.configure_optimizers = _hooked(model.configure_optimizers, after_local_step)
    trainer.fit(model, datamodule=ByteDataModule(**DATA), ckpt_path=ckpt_in)
    state = trainer.strategy.hook_state
    return {"rows": recorder.rows, "params": _flat_params(model), "replay": recorder.replay if case in TORCH_HOOKS
            else None, "half": recorder.half, "mixed": recorder.mixed, "summary": trainer.strategy.comm_summary(),
            "hook_state": state.state_dict(), "metrics_csv": str(out / "metrics.csv"),
            "numels": [p.numel() for p in model.parameters()], "shapes": [tuple(p.shape) for p in model.parameters()]}


def _hooked(configure, post_hook):
    """``configure_optimizers`` whose optimizer calls ``post_hook`` after each step."""
    @functools.wraps(configure)
    def wrapped():
        out = configure()
        optimizer = out["optimizer"] if isinstance(out, dict) else out
        optimizer.register_step_post_hook(post_hook)
        return out
    return wrapped


class _Loss(nn.Module):
    """The LanguageModel's training loss as a module's forward (for a plain DDP model)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return self.lm._loss(batch)


def _torch_hook(case: str) -> tuple[Any, Any]:
    """(state, hook) of torch's own hook that strategy ``case`` runs."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

    if case == "powersgd":
        return torch_powersgd.PowerSGDState(process_group=None, **POWERSGD), torch_powersgd.powerSGD_hook
    if case == "powersgd_buckets":  # torch's hook waited for bucket by bucket: alone it aborts on gloo here
        return torch_powersgd.PowerSGDState(process_group=None, **POWERSGD_BUCKETS), _one_bucket_at_a_time
    return None, default_hooks.fp16_compress_hook


def _one_bucket_at_a_time(state, bucket):  # no annotation: DDP checks a string one against the Future type
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

    fut = torch_powersgd.powerSGD_hook(state, bucket)
    fut.wait()
    return fut


TORCH_HOOKS = ("powersgd", "fp16_compress")


def replay_with_torchs_hook(case: str, replay: list[dict[str, Any]], **ddp_kwargs: Any) -> list[list[torch.Tensor]]:
    """The recorded steps through torch's own hook by hand: a plain DDP model with the strategy's arguments,
    each step's params and batch; returns the gradients DDP hands back."""
    from lightning_optim.model import LanguageModel

    lm = LanguageModel(MODEL, SEQ_LEN, optimizer=_adamw, scheduler=SCHEDULER)
    ddp = nn.parallel.DistributedDataParallel(_Loss(lm), **ddp_kwargs)
    ddp.register_comm_hook(*_torch_hook(case))
    grads = []
    for step in replay:
        with torch.no_grad():
            lm.load_state_dict(step["params"])
        ddp.zero_grad(set_to_none=True)
        ddp(step["batch"]).backward()
        grads.append([p.grad.detach().clone() for p in lm.parameters()])
    return grads


def _refused(out: Path, make_strategy, **fit_kwargs) -> str:
    try:
        _fit("topk", out, max_steps=1, strategy=make_strategy(), **fit_kwargs)
    except Exception as exc:  # noqa: BLE001 - the message goes back to the test
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _warned(fit) -> tuple[dict[str, Any], list[str]]:
    """``fit()``'s result and the warnings about ``start_powerSGD_iter`` it gave."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fit()
    return result, [str(w.message) for w in caught if "start_powerSGD_iter" in str(w.message)]


def powersgd_on_gloo(tmp_path: Path) -> dict[str, Any]:
    """PowerSGD with several buckets past its start (``PowerSGDStrategy(start_powerSGD_iter=10)``) and by name in
    a fit shorter than its default start."""
    import lightning_optim.lightning.strategies as strategies

    def buckets() -> dict[str, Any]:
        strategy = strategies.PowerSGDStrategy(**POWERSGD_BUCKETS, bucket_cap_mb=BUCKET_CAP_MB, timeout=60)
        run = _fit("powersgd", tmp_path / "powersgd_buckets", max_steps=BUCKET_STEPS, strategy=strategy)
        state = strategy.hook_state
        return {**run, "buckets": len(state._layouts), "iter": state.torch_state.iter}

    def by_name() -> dict[str, Any]:
        run = _fit("powersgd", tmp_path / "powersgd_by_name", max_steps=BY_NAME_STEPS, strategy="powersgd")
        return {**run, "iter": run["hook_state"]["torch_state"]["iter"]}

    out: dict[str, Any] = {}
    out["buckets"], out["buckets_warnings"] = _warned(buckets)
    out["buckets"]["by_hand"] = replay_with_torchs_hook("powersgd_buckets", out["buckets"]["replay"],
                                                        bucket_cap_mb=BUCKET_CAP_MB)
    out["by_name"], out["by_name_warnings"] = _warned(by_name)
    return out


def suite(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """Everything the 2-rank strategy tests check, in one spawn."""
    import lightning_optim
    import lightning_optim.lightning.strategies as strategies
    from lightning_optim.lightning import GradientRelease

    _lightning_env(rank, world)
    tmp_path = Path(tmp)
    out: dict[str, Any] = {}
    for case in CASES:
        full = _fit(case, tmp_path / case / "full", max_steps=2 * RESUME_EPOCH,
                    checkpoint_dir=str(tmp_path / case / "ckpts"))
        ckpt = str(tmp_path / case / "ckpts" / f"epoch=0-step={RESUME_EPOCH}.ckpt")
        resumed = _fit(case, tmp_path / case / "resumed", max_steps=2 * RESUME_EPOCH, ckpt_in=ckpt)
        out[case] = {**full, "resumed": resumed, "ckpt": ckpt}
    for case in TORCH_HOOKS:
        out[case]["by_hand"] = replay_with_torchs_hook(case, out[case]["replay"])
    out["powersgd_on_gloo"] = powersgd_on_gloo(tmp_path)
    out["refused"] = {  # last: a failed fit may leave Lightning's state behind
        "onebit_optimizer": _refused(tmp_path / "r1", lambda: strategies.TopKStrategy(timeout=60),
                                     optimizer=functools.partial(lightning_optim.OnebitAdam, lr=1e-3)),
        "gradient_release": _refused(tmp_path / "r2", lambda: strategies.TopKStrategy(timeout=60),
                                     callbacks=[GradientRelease()], gradient_clip_val=None),
        "missing_rank": _refused(tmp_path / "r3",
                                 lambda: strategies.DecentralizedStrategy(neighbors=[[1], [0, 2]], timeout=60)),
    }
    return out
