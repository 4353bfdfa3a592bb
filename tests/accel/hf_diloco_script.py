"""Run by torchrun (2 CPU ranks): the HF Trainer with DiLoCo from this very command line, parsed by
``HfArgumentParser((TrainingArguments, DiLoCoArguments))``; a tiny GPT-2 trained on the Python standard library's
bytes. ``--trainer library``: ``accel_plugins.hf.TrainingArguments`` and ``Trainer``; ``--trainer stock``:
``accel_plugins.hf.register()``, then the stock ``transformers`` classes. A recording callback notes, per
optimizer step, the bytes sent between ``on_step_begin`` and ``on_step_end`` (the kernel's socket counters and
comm_stats) and the params. Each rank writes OUTPUT_DIR/result<r>.pt.

    torchrun --nproc_per_node 2 hf_diloco_script.py --output_dir OUT --diloco_sync_every 4 --max_steps 12 ...
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


class Recorder(transformers.TrainerCallback):
    def __init__(self) -> None:
        self.rows: list[dict] = []
        self._start = (0, 0)

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = (wire_bytes_sent(), comm_stats().bytes_sent)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        wire = wire_bytes_sent()
        self.rows.append({"step": state.global_step, "stats_bytes": comm_stats().bytes_sent - self._start[1],
                          "wire_bytes": None if wire is None or self._start[0] is None else wire - self._start[0],
                          "params": torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])})


# --trainer first (the stock parser must be built after register()), then the whole argv as a user's script parses it
if HfArgumentParser(ScriptArguments).parse_known_args()[0].trainer == "stock":
    accel_plugins.hf.register()
    arguments_class, trainer_class = transformers.TrainingArguments, transformers.Trainer
else:
    arguments_class, trainer_class = accel_plugins.hf.TrainingArguments, accel_plugins.hf.Trainer
parser = HfArgumentParser((arguments_class, accel_plugins.hf.DiLoCoArguments, ScriptArguments))
args, diloco_args, _ = parser.parse_args_into_dataclasses()

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=1, n_head=2))
train, _ = load_corpus(None, "*.py", max_bytes=100_000, val_fraction=0.1)
windows = RandomWindows(torch.frombuffer(bytearray(train), dtype=torch.uint8), 32, 512, seed=0)
data = [{"input_ids": w[:32].long(), "labels": w[:32].long()} for w in (windows[i] for i in range(len(windows)))]
diloco = diloco_args.callback()
recorder = Recorder()
trainer = trainer_class(model=model, args=args, train_dataset=data, callbacks=[diloco, recorder])
trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
torch.save({"params": [p.detach().clone() for p in model.parameters()], "trainer": type(trainer).__module__,
            "rows": recorder.rows, "log": trainer.state.log_history, "inner_steps": diloco.diloco.inner_steps,
            "inner": type(diloco.diloco.inner).__name__, "stepping": type(trainer.optimizer.optimizer).__name__,
            "buckets_local": diloco.hook.buckets_local, "bytes_sent": diloco.comm_stats().bytes_sent},
           f"{args.output_dir}/result{trainer.args.process_index}.pt")
trainer.accelerator.free_memory()
del trainer, model
gc.collect()
