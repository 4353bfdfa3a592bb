"""Run by torchrun (2 CPU ranks): the HF Trainer with DiLoCo from this very command line, parsed by
``HfArgumentParser((TrainingArguments, DiLoCoArguments))``; a tiny GPT-2 trained on the Python standard library's
bytes. ``--trainer library``: ``accel_plugins.hf.TrainingArguments`` and ``Trainer``; ``--trainer stock``:
``accel_plugins.hf.register()``, then the stock ``transformers`` classes. A recording callback notes, per
optimizer step, the bytes sent between ``on_step_begin`` and ``on_step_end`` (the kernel's socket counters and
comm_stats) and the params. Each rank writes OUTPUT_DIR/result<r>.pt.

One launch runs several phases (tests/accel/phases.py), each one user's command line, separated by ``then``:

    torchrun --nproc_per_node 2 hf_diloco_script.py --output_dir OUT/full --diloco_sync_every 4 --max_steps 12 ... \
        then --output_dir OUT/resumed --trainer stock --resume_from_checkpoint OUT/full/checkpoint-6 ...

Why a phase stands for its own launch: ``sys.argv`` becomes the phase's command line, which a parser built for its
route parses as a user's script does (after ``register()`` for the stock route, after ``unregister()`` for the
library one); the phase builds the arguments (which set Accelerate's state up anew), model, data, callbacks and
Trainer afresh, and ``phases.start_phase`` resets what else is process-wide (Accelerate's singletons, comm_stats'
counter). A resumed phase therefore holds nothing of the run that wrote its checkpoint: model, HF's optimizer, every
rank's DiLoCo state (``diloco_rank<r>.pt``) and random states come from the checkpoint on disk, as in a user's
resumed run.
"""

import gc
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser

import accel_plugins.hf
from lightning_optim.comm import comm_stats

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, when run as a script
from tests.accel.hf_route import ScriptArguments, training_data, use_route  # noqa: E402
from tests.accel.phases import split_phases, start_phase  # noqa: E402
from tests.wire import wire_bytes_sent  # noqa: E402


@dataclass
class DropRankState:
    """``--drop_rank_state R``: resume from a copy of ``--resume_from_checkpoint`` without ``diloco_rank<R>.pt``
    (a rank whose file went missing), made by rank 0 in OUTPUT_DIR/checkpoint-copy before the Trainer starts."""

    drop_rank_state: int | None = field(default=None)


def _copy_without_rank_state(checkpoint: str, output_dir: str, rank: int) -> str:
    copy = Path(output_dir) / "checkpoint-copy"
    if torch.distributed.get_rank() == 0:
        shutil.copytree(checkpoint, copy, ignore=shutil.ignore_patterns(f"diloco_rank{rank}.pt"))
    torch.distributed.barrier()
    return str(copy)


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


def run_phase() -> None:
    """One user's run: parse the whole command line (``sys.argv``), train, save this rank's result."""
    start_phase()
    arguments_class, trainer_class = use_route()
    parser = HfArgumentParser((arguments_class, accel_plugins.hf.DiLoCoArguments, ScriptArguments, DropRankState))
    args, diloco_args, _, drop = parser.parse_args_into_dataclasses()
    if drop.drop_rank_state is not None:
        args.resume_from_checkpoint = _copy_without_rank_state(args.resume_from_checkpoint, args.output_dir,
                                                               drop.drop_rank_state)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=1, n_head=2))
    diloco = diloco_args.callback()
    recorder = Recorder()
    trainer = trainer_class(model=model, args=args, train_dataset=training_data(max_bytes=100_000),
                            callbacks=[diloco, recorder])
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    torch.save({"params": [p.detach().clone() for p in model.parameters()], "trainer": type(trainer).__module__,
                "rows": recorder.rows, "log": trainer.state.log_history, "inner_steps": diloco.diloco.inner_steps,
                "inner": type(diloco.diloco.inner).__name__, "stepping": type(trainer.optimizer.optimizer).__name__,
                "buckets_local": diloco.hook.buckets_local, "bytes_sent": diloco.comm_stats().bytes_sent,
                "compressor": diloco.diloco.compressor_name, "density": diloco.diloco.density,
                "bits": diloco.diloco.bits, "outer_momenta": len(diloco.diloco.outer_momenta)},
               f"{args.output_dir}/result{trainer.args.process_index}.pt")
    trainer.accelerator.free_memory()
    del trainer, model, diloco
    gc.collect()


for phase in split_phases(sys.argv[1:]):
    sys.argv[1:] = phase  # the command line of this phase's own launch, which HfArgumentParser reads as users' do
    run_phase()
