"""Rank side of the fault-tolerant DiLoCo refusals that need an Accelerate run of two processes (inside
run_workers' gloo group): a manager means one process per replica group, so both routes refuse such a run,
naming the argument, before they change anything or build a manager."""

from __future__ import annotations

import torch
from torch import nn

from tests.accel.refusal_workers import new_accelerator


def enable_diloco_refused(rank: int, world: int, lighthouse: str) -> dict:
    """``enable_diloco(..., manager=...)`` on a prepared DDP model of a two-process run."""
    import accel_plugins
    from lightning_optim import fault_tolerance

    # before new_accelerator sets RANK/WORLD_SIZE: a one-process replica group's manager, as a user's launch makes
    manager = fault_tolerance.replica_manager(replica_id=f"w{rank}", lighthouse=lighthouse, host="localhost")
    accelerator = new_accelerator(rank, world, cpu=True)
    model = nn.Linear(4, 2)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    inner = optimizer.optimizer
    try:
        accel_plugins.enable_diloco(accelerator, model, optimizer, sync_every=4, manager=manager)
        message = "accepted"
    except ValueError as exc:
        message = str(exc)
    result = {"message": message, "processes": accelerator.num_processes, "unchanged": optimizer.optimizer is inner,
              "hooks": len(accelerator._save_model_state_pre_hook) + len(accelerator._load_model_state_pre_hook),
              "comm_hooks": len(getattr(model, "_comm_hooks", []) or []), "committed": manager.current_step()}
    manager.shutdown(wait=False)
    return result


def both_refused(rank: int, world: int, lighthouse: str, output_dir: str) -> tuple[dict, dict]:
    """Both routes in turn, in one pair of rank processes."""
    return enable_diloco_refused(rank, world, lighthouse), trainer_refused(rank, world, output_dir)


def trainer_refused(rank: int, world: int, output_dir: str) -> dict:
    """``DiLoCoCallback(fault_tolerant=True)`` in a Trainer of two processes: refused at ``train()``'s start,
    before the callback builds its manager (the Lighthouse address given is never reached)."""
    import os

    from accelerate.state import AcceleratorState
    from transformers import GPT2Config, GPT2LMHeadModel

    import accel_plugins.hf

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    AcceleratorState._reset_state(reset_partial_state=True)
    args = accel_plugins.hf.TrainingArguments(output_dir, use_cpu=True, max_steps=2, report_to="none",
                                              per_device_train_batch_size=2)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=2, bos_token_id=0,
                                       eos_token_id=0))
    data = [{"input_ids": torch.arange(8) % 16, "labels": torch.arange(8) % 16}] * 8
    callback = accel_plugins.hf.DiLoCoCallback(sync_every=2, fault_tolerant=True, replica_id=f"w{rank}",
                                               lighthouse="localhost:1")
    trainer = accel_plugins.hf.Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    try:
        trainer.train()
        message = "accepted"
    except ValueError as exc:
        message = str(exc)
    return {"message": message, "processes": trainer.accelerator.num_processes, "manager": callback.manager,
            "diloco": callback.diloco, "stepping": type(trainer.optimizer.optimizer).__name__}
