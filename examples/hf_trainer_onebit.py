"""1-bit Adam through the Hugging Face Trainer's ``--optim``, on real text, with no download.

    torchrun --nproc_per_node 2 examples/hf_trainer_onebit.py --optim onebit_adam --optim_args freeze_step=60
    torchrun --nproc_per_node 2 examples/hf_trainer_onebit.py --optim adamw_torch          # the baseline

A GPT-2 built from a tiny config (no weights downloaded) learns the Python standard library's bytes.
Any ``TrainingArguments`` flag works (these defaults come first, so yours win); on GPUs drop
``--use_cpu``. Rank 0 prints the final eval loss and, for a 1-bit optimizer, the bytes sent.
"""

from __future__ import annotations

import gc
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser

from accel_plugins.hf import Trainer, TrainingArguments
from lightning_optim.data import RandomWindows, load_corpus

SEQ = 64
DEFAULTS = ["--output_dir", "hf_onebit_out", "--max_steps", "240", "--learning_rate", "3e-3", "--warmup_steps", "20",
            "--lr_scheduler_type", "cosine", "--weight_decay", "0.1", "--adam_beta2", "0.99",
            "--per_device_train_batch_size", "16", "--per_device_eval_batch_size", "32", "--logging_steps", "20",
            "--save_strategy", "no", "--report_to", "none", "--seed", "0", "--use_cpu",
            "--dataloader_drop_last", "true"]
(args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(DEFAULTS + sys.argv[1:])

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=SEQ, n_embd=128, n_layer=2, n_head=4))
train_text, val_text = load_corpus(None, "*.py", max_bytes=1_000_000, val_fraction=0.1)


def windows(text: bytes, count: int, seed: int) -> list[dict]:
    w = RandomWindows(torch.frombuffer(bytearray(text), dtype=torch.uint8), SEQ, count, seed=seed)
    return [{"input_ids": w[i][:SEQ].long(), "labels": w[i][:SEQ].long()} for i in range(len(w))]


trainer = Trainer(model=model, args=args, train_dataset=windows(train_text, 8192, 0),
                  eval_dataset=windows(val_text, 256, 1))
trainer.train()
metrics = trainer.evaluate()
if trainer.is_world_process_zero():
    line = f"optim {getattr(args.optim, 'value', args.optim)}: eval loss {metrics['eval_loss']:.4f} after {trainer.state.global_step} steps"
    if trainer._onebit_handle is not None:
        s = trainer._onebit_handle.summary()
        line += f"; sent {s['bytes_sent'] / 1e6:.1f} MB vs {s['fp32_equivalent_bytes'] / 1e6:.1f} MB for fp32 DDP"
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        if getattr(optimizer, "auto_freeze", False):
            line += f"; freeze_step='auto' chose step {optimizer.freeze_step}"
    print(line, flush=True)
if trainer._onebit_handle is not None:  # free DDP and the optimizer while the group exists (OnebitHandle.close)
    trainer._onebit_handle.close()
trainer.accelerator.free_memory()
del trainer, model
gc.collect()
