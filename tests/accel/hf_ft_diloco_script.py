"""One replica group of a fault-tolerant DiLoCo run under the HF Trainer, launched as users launch one (one
process): DiLoCo and its replica manager from this very command line, parsed by
``HfArgumentParser((TrainingArguments, DiLoCoArguments, ...))``:

    python hf_ft_diloco_script.py --output_dir OUT --data_shard 0 --diloco_sync_every 4 \
        --diloco_replica_id r0 --diloco_lighthouse HOST:PORT --max_steps 12 --save_steps 6 --use_cpu ...

The model is a tiny GPT-2 built from its config (no dropout); the data this replica's own shard (``--data_shard``)
of random token windows, an ``IterableDataset`` read in order (batch ``i`` holds windows ``i*B .. i*B+B-1``, so
the test rebuilds every replica's batches for its reference). A recording callback notes the params after every
optimizer step; OUTPUT_DIR/result.pt holds them, the final params, and what the callback built (the manager, the
classes the optimizer steps through). ``--own_manager True``: the script builds the manager itself from the same
options and passes ``DiLoCoCallback(manager=...)``, the other way in.
"""

import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser

import accel_plugins.hf
from lightning_optim import fault_tolerance

VOCAB, WINDOW = 64, 16


def tiny_gpt2(seed: int) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=WINDOW, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def window(shard: int, i: int) -> dict[str, torch.Tensor]:
    """Window ``i`` of ``shard``: token ids as inputs and labels (the model shifts them). The first label, never a
    target, is masked: the Trainer's token count (``num_items_in_batch``) is then the count of targets whether or
    not it knows that the loss shifts, so its loss is the model's mean loss for every release."""
    ids = torch.randint(0, VOCAB, (WINDOW,), generator=torch.Generator().manual_seed(1_000_003 * (shard + 1) + i))
    labels = ids.clone()
    labels[0] = -100
    return {"input_ids": ids, "labels": labels}


class Shard(torch.utils.data.IterableDataset):
    """This replica's windows, in order, without end (the Trainer stops at ``max_steps``)."""

    def __init__(self, shard: int) -> None:
        self.shard = shard

    def __iter__(self):
        i = 0
        while True:
            yield window(self.shard, i)
            i += 1


@dataclass
class ScriptArguments:
    data_shard: int = field(default=0, metadata={"help": "this replica's shard of the data"})
    model_seed: int = field(default=0, metadata={"help": "the seed the model is built with"})
    own_manager: bool = field(default=False, metadata={
        "help": "build the manager here (replica_manager) and pass it as DiLoCoCallback(manager=...)"})


class Recorder(transformers.TrainerCallback):
    def __init__(self) -> None:
        self.rows: list[dict] = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.rows.append({"step": state.global_step,
                          "params": torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])})


def main() -> None:
    parser = HfArgumentParser((accel_plugins.hf.TrainingArguments, accel_plugins.hf.DiLoCoArguments, ScriptArguments))
    args, diloco_args, script = parser.parse_args_into_dataclasses()
    torch.set_num_threads(1)
    model = tiny_gpt2(script.model_seed)
    if script.own_manager:  # the other way in: a manager the user built, its address from the same options
        manager = fault_tolerance.replica_manager(replica_id=diloco_args.diloco_replica_id,
                                                  lighthouse=diloco_args.diloco_lighthouse)
        diloco = accel_plugins.hf.DiLoCoCallback(sync_every=diloco_args.diloco_sync_every, manager=manager)
    else:
        diloco = diloco_args.callback()
    recorder = Recorder()
    trainer = accel_plugins.hf.Trainer(model=model, args=args, train_dataset=Shard(script.data_shard),
                                       callbacks=[diloco, recorder])
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    torch.save({"rows": recorder.rows, "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
                "inner_steps": diloco.diloco.inner_steps, "inner": type(diloco.diloco.inner).__name__,
                "stepping": type(trainer.optimizer.optimizer).__name__, "processes": trainer.accelerator.num_processes,
                "manager": type(diloco.manager).__module__ + "." + type(diloco.manager).__name__,
                "built_by_callback": diloco.replica_options is not None,
                "committed": diloco.manager.current_step(), "discarded": diloco.diloco.replicas.rounds_discarded,
                "log": trainer.state.log_history}, Path(args.output_dir) / "result.pt")
    diloco.manager.shutdown(wait=False)


if __name__ == "__main__":
    sys.exit(main())
