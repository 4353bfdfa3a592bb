"""Run by torchrun (2 CPU ranks): the HF Trainer with ``--optim onebit_adam`` parsed from this very
command line by HfArgumentParser; a tiny GPT-2 built from a config, trained on the Python standard
library's bytes. ``--trainer library`` (default): ``accel_plugins.hf.TrainingArguments`` and ``Trainer``;
``--trainer stock``: ``accel_plugins.hf.register()``, then the stock ``transformers.TrainingArguments``,
``HfArgumentParser`` and ``Trainer``. Each rank writes OUTPUT_DIR/result<r>.pt.

    torchrun --nproc_per_node 2 hf_script.py --output_dir OUT --optim onebit_adam --optim_args freeze_step=3 ...
"""

import gc
import os
import re
import subprocess
from dataclasses import dataclass, field

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser

import accel_plugins.hf
from lightning_optim.comm import comm_stats
from lightning_optim.data import RandomWindows, load_corpus


@dataclass
class ScriptArguments:
    trainer: str = field(default="library", metadata={"choices": ["library", "stock"]})


def wire_bytes_sent() -> int | None:
    """What this process's open TCP sockets to other ranks have sent, as the kernel counts it (``ss -tinp``:
    gloo's pairs), independent of comm_stats; None where ``ss`` is missing. Each byte once: ``bytes_sent`` counts
    retransmissions too, and loopback does retransmit (probes and spurious resends while the receiving rank is
    not scheduled: seen on an idle machine; CI saw a rank 53 KB "heavier" that way), so ``bytes_retrans`` is taken off. The rendezvous store's socket (to
    MASTER_PORT) is left out: it polls while ranks wait for each other, so its bytes follow the machine's load."""
    try:
        out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    store = f":{os.environ.get('MASTER_PORT', '')}"
    total, mine = 0, False
    for line in out.splitlines():
        if not line[:1].isspace():  # a socket's line; its counters follow on an indented line
            fields = line.split()
            mine = f"pid={os.getpid()}," in line and not any(f.endswith(store) for f in fields[3:5])
        elif mine and (found := re.search(r"\bbytes_sent:(\d+)", line)):
            retransmitted = re.search(r"\bbytes_retrans:(\d+)", line)
            total += int(found.group(1)) - (int(retransmitted.group(1)) if retransmitted else 0)
    return total


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
