"""Run by torchrun (2 CPU ranks): the HF Trainer with ``--optim onebit_adam`` parsed from this very
command line by HfArgumentParser (accel_plugins.hf.TrainingArguments); a tiny GPT-2 built from a
config, trained on the Python standard library's bytes. Each rank writes OUTPUT_DIR/result<r>.pt.

    torchrun --nproc_per_node 2 hf_script.py --output_dir OUT --optim onebit_adam --optim_args freeze_step=3 ...
"""

import gc

import torch
from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser

from accel_plugins.hf import Trainer, TrainingArguments
from lightning_optim.data import RandomWindows, load_corpus

(args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=2))
train, _ = load_corpus(None, "*.py", max_bytes=200_000, val_fraction=0.1)
windows = RandomWindows(torch.frombuffer(bytearray(train), dtype=torch.uint8), 32, 512, seed=0)
data = [{"input_ids": w[:32].long(), "labels": w[:32].long()} for w in (windows[i] for i in range(len(windows)))]
trainer = Trainer(model=model, args=args, train_dataset=data)
trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
handle = trainer._onebit_handle
torch.save({"params": [p.detach().clone() for p in model.parameters()],
            "log": trainer.state.log_history, "optimizer": type(trainer.onebit_optimizer).__name__,
            "summary": handle.summary() if handle else None},
           f"{args.output_dir}/result{trainer.args.process_index}.pt")
if handle is not None:  # free the DDP model and optimizer while the group exists (OnebitHandle.close)
    handle.close()
trainer.accelerator.free_memory()
del trainer, model, handle
gc.collect()
