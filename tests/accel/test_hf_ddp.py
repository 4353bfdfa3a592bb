"""The HF Trainer with ``--optim onebit_adam`` parsed from a real command line under ``torchrun
--nproc_per_node 2`` (gloo, CPU), through ``accel_plugins.hf.Trainer`` and through the stock
``transformers`` classes after ``accel_plugins.hf.register()``: loss falls, compression engages (DDP
buckets skipped, logged compression ratio ~32x in the 1-bit steps), the stock Trainer sends the library
Trainer's bytes (comm_stats and the kernel's socket counters) and writes its checkpoints, and
``resume_from_checkpoint`` (every rank's own error-feedback state) ends bitwise equal to the
uninterrupted run. The three runs are phases of one launch (tests/accel/phases.py); the example is its own
launch, run as users run it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from tests.accel.phases import rank_results, run_phases  # noqa: E402
from tests.distributed import run_torchrun  # noqa: E402

SCRIPT = Path(__file__).with_name("hf_script.py")
REPO = Path(__file__).resolve().parents[2]
COMMON = ["--optim", "onebit_adam", "--optim_args", "freeze_step=3,kahan_sum=False", "--learning_rate", "3e-3",
          "--max_steps", "8", "--save_steps", "4", "--logging_steps", "1", "--per_device_train_batch_size", "8",
          "--use_cpu", "--report_to", "none", "--seed", "0", "--max_grad_norm", "1.0"]


def _phase(out: Path, *extra: str) -> list[str]:
    return ["--output_dir", str(out), *COMMON, *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf")
    phases = {"library": _phase(tmp / "library"), "stock": _phase(tmp / "stock", "--trainer", "stock"),
              "resumed": _phase(tmp / "resumed", "--trainer", "stock", "--resume_from_checkpoint",
                                str(tmp / "stock" / "checkpoint-4"))}
    run_phases(SCRIPT, list(phases.values()), cwd=REPO)
    return {**{name: rank_results(tmp / name, "result") for name in phases},
            "dirs": {"library": tmp / "library", "stock": tmp / "stock"}}


@pytest.mark.parametrize("route", ["library", "stock"])
def test_onebit_adam_from_the_command_line_compresses_under_ddp(runs, route):
    run = runs[route]
    assert run[0]["trainer"] == {"library": "accel_plugins.hf", "stock": "transformers.trainer"}[route]
    assert run[0]["optimizer"] == "OnebitAdam"
    logs = [row for row in run[0]["log"] if "loss" in row]
    assert logs[-1]["loss"] < logs[0]["loss"]
    ratios = [row["comm/compression_ratio"] for row in logs]
    assert all(0.9 < r < 1.1 for r in ratios[:3]), ratios  # warmup: DDP's fp32 allreduce
    assert all(20 < r < 33 for r in ratios[4:]), ratios  # 1-bit steps
    assert run[0]["summary"]["buckets_skipped"] > 0
    assert run[0]["unmanaged_steps"] == run[1]["unmanaged_steps"] == 0  # nothing compressed beside DDP's allreduce
    for a, b in zip(run[0]["params"], run[1]["params"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("route", ["library", "stock"])
def test_max_grad_norm_in_the_compression_stage_uses_one_agreed_norm(runs, route):
    norms = [[row["grad_norm"] for row in run["log"] if "grad_norm" in row] for run in runs[route]]
    assert len(norms[0]) == 8 and norms[0] == norms[1]  # per-rank clipping would log each rank's own norm
    assert all(n > 0 for n in norms[0])


def test_the_stock_trainer_trains_and_sends_as_the_library_trainer(runs):
    library, stock = runs["library"], runs["stock"]
    for rank in range(2):
        for a, b in zip(library[rank]["params"], stock[rank]["params"]):
            assert torch.equal(a, b)
        sent = [run[rank]["summary"]["bytes_sent"] for run in (library, stock)]
        assert abs(sent[1] - sent[0]) <= 0.01 * sent[0], sent
        logged = [[row["comm/bytes_sent"] for row in run[rank]["log"] if "loss" in row] for run in (library, stock)]
        assert logged[0] == logged[1]


def test_the_stock_trainer_puts_the_library_trainers_bytes_on_the_wire(runs):
    wire = [[run[rank]["wire_bytes_sent"] for rank in range(2)] for run in (runs["library"], runs["stock"])]
    if None in wire[0] + wire[1]:
        pytest.skip("no `ss` to read the sockets' byte counters")
    for rank in range(2):
        library, stock = wire[0][rank], wire[1][rank]
        assert abs(stock - library) <= 0.01 * library, wire
        # DDP's fp32 allreduce left on in the 1-bit steps would send about 4x comm_stats' count here
        assert library < 1.5 * runs["library"][rank]["summary"]["bytes_sent"], wire


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("name", ["optimizer.pt", "onebit_rank0.pt", "onebit_rank1.pt"])
def test_the_stock_trainer_writes_the_library_trainers_checkpoints(runs, name):
    library, stock = (torch.load(runs["dirs"][route] / "checkpoint-4" / name, weights_only=False)
                      for route in ("library", "stock"))
    assert _same(library, stock)


def test_resume_from_checkpoint_is_bitwise(runs):
    for rank in range(2):
        for full, resumed in zip(runs["stock"][rank]["params"], runs["resumed"][rank]["params"]):
            assert torch.equal(full, resumed)


def test_the_hf_example_runs_as_it_is(tmp_path):
    done = run_torchrun(REPO / "examples" / "hf_trainer_onebit.py", "--optim", "onebit_adam", "--optim_args",
                        "freeze_step=10", "--max_steps", "24", "--output_dir", tmp_path, cwd=tmp_path)
    line = next(line for line in done.stdout.splitlines() if line.startswith("optim onebit_adam"))
    eval_loss = float(line.split("eval loss ")[1].split()[0])
    assert eval_loss < 5.0  # ln 256 = 5.55 before training
    assert "MB vs" in line
