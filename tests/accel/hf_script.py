"""Run by torchrun (2 CPU ranks): the HF Trainer with ``--optim onebit_adam`` parsed from this very
command line by HfArgumentParser; a tiny GPT-2 built from a config, trained on the Python standard
library's bytes. ``--trainer library`` (default): ``accel_plugins.hf.TrainingArguments`` and ``Trainer``;
``--trainer stock``: ``accel_plugins.hf.register()``, then the stock ``transformers.TrainingArguments``,
``HfArgumentParser`` and ``Trainer``. Each rank writes OUTPUT_DIR/result<r>.pt.

    torchrun --nproc_per_node 2 hf_script.py --output_dir OUT --optim onebit_adam --optim_args freeze_step=3 ...
"""

import gc
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser

import accel_plugins.hf
from lightning_optim.comm import comm_stats
from lightning_optim.data import RandomWindows, load_corpus

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, when run as a script
from tests.wire import wire_bytes_sent  # noqa: E402


@dataclass
class ScriptArguments:
    trainer: str = field(default="library", metadata={"choices": ["library", "stock"]})


# --trainer first (the stock parser must be built after register()), then the whole argv as a user's script parses it
if HfArgumentParser(ScriptArguments).parse_known_args()[0].trainer == "stock":
    accel_plugins.hf.register()
    arguments_class, trainer_class = transformers.TrainingArguments, transformers.Trainer
else:
    arguments_class, trainer_class = accel_plugins.hf.TrainingArguments, accel_plugins.hf.Trainer
args, _ = HfArgumentParser((arguments_class, ScriptArguments)).parse_args_into_dataclasses()

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=2))
train, _ = load_corpus(None, "*.py", max_bytes=200_000, val_fraction=0.1)
windows = RandomWindows(torch.frombuffer(bytearray(train), dtype=torch.uint8), 32, 512, seed=0)
data = [{"input_ids": w[:32].long(), "labels": w[:32].long()} for w in (windows[i] for i in range(len(windows)))]
trainer = trainer_class(model=model, args=args, train_dataset=data)
trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
handle = trainer._onebit_handle
stats = comm_stats()
torch.save({"params": [p.detach().clone() for p in model.parameters()], "trainer": type(trainer).__module__,
            "log": trainer.state.log_history, "optimizer": type(trainer.onebit_optimizer).__name__,
            "summary": handle.summary() if handle else None, "wire_bytes_sent": wire_bytes_sent(),
            "unmanaged_steps": stats.unmanaged_steps},
           f"{args.output_dir}/result{trainer.args.process_index}.pt")
if handle is not None:  # free the DDP model and optimizer while the group exists (OnebitHandle.close)
    handle.close()
trainer.accelerator.free_memory()
del trainer, model, handle
gc.collect()
