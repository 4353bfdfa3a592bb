"""Run by torchrun (2 CPU ranks): the HF Trainer with ``--optim onebit_adam`` parsed by HfArgumentParser from
the command line; a tiny GPT-2 built from a config, trained on the Python standard library's bytes.
``--trainer library`` (default): ``accel_plugins.hf.TrainingArguments`` and ``Trainer``; ``--trainer stock``:
``accel_plugins.hf.register()``, then the stock ``transformers.TrainingArguments``, ``HfArgumentParser`` and
``Trainer``. Each rank writes OUTPUT_DIR/result<r>.pt.

One launch runs several phases (tests/accel/phases.py), each one user's command line, separated by ``then``:

    torchrun --nproc_per_node 2 hf_script.py --output_dir OUT/library --optim onebit_adam ... \
        then --output_dir OUT/stock --trainer stock ... \
        then --output_dir OUT/resumed --trainer stock --resume_from_checkpoint OUT/stock/checkpoint-4 ...

Why a phase stands for its own launch: ``sys.argv`` becomes the phase's command line, which a parser built for its
route parses as a user's script does (after ``register()`` for the stock route, after ``unregister()`` for the
library one); the phase builds the arguments (which set Accelerate's state up anew), model, data and Trainer afresh,
and ``phases.start_phase`` resets what else is process-wide (Accelerate's singletons, comm_stats' counter, the
compression caches). A resumed phase therefore holds nothing of the run that wrote its checkpoint: model,
optimizer, every rank's 1-bit state, scheduler and random states come from the checkpoint on disk, as in a user's
resumed run. The socket byte counts are the phase's own (differences within it).
"""

import gc
import sys
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser

from lightning_optim.comm import comm_stats

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, when run as a script
from tests.accel.hf_route import ScriptArguments, training_data, use_route  # noqa: E402
from tests.accel.phases import split_phases, start_phase  # noqa: E402
from tests.wire import wire_bytes_sent  # noqa: E402


def run_phase() -> None:
    """One user's run: parse the whole command line (``sys.argv``), train, save this rank's result."""
    start_phase()
    arguments_class, trainer_class = use_route()
    args, _ = HfArgumentParser((arguments_class, ScriptArguments)).parse_args_into_dataclasses()
    assert args.world_size > 1  # sets the process group up in the first phase: its connection's bytes are no phase's
    wire_at_start = wire_bytes_sent()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=2))
    trainer = trainer_class(model=model, args=args, train_dataset=training_data(max_bytes=200_000))
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    handle = trainer._onebit_handle
    stats = comm_stats()
    wire_at_end = wire_bytes_sent()
    torch.save({"params": [p.detach().clone() for p in model.parameters()], "trainer": type(trainer).__module__,
                "log": trainer.state.log_history, "optimizer": type(trainer.onebit_optimizer).__name__,
                "summary": handle.summary() if handle else None,
                "wire_bytes_sent": None if None in (wire_at_start, wire_at_end) else wire_at_end - wire_at_start,
                "unmanaged_steps": stats.unmanaged_steps},
               f"{args.output_dir}/result{trainer.args.process_index}.pt")
    if handle is not None:  # free the DDP model and optimizer while the group exists (OnebitHandle.close)
        handle.close()
    trainer.accelerator.free_memory()
    del trainer, model, handle
    gc.collect()


for phase in split_phases(sys.argv[1:]):
    sys.argv[1:] = phase  # the command line of this phase's own launch, which HfArgumentParser reads as users' do
    run_phase()
