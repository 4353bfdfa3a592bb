"""The main job's default is 1-bit Adam on 2 CPU processes (Hydra + Lightning's launcher)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
from pathlib import Path

import hydra
import pytest
from omegaconf import OmegaConf

from lightning_optim.config_check import check_config
from lightning_optim.lightning import OnebitAdamStrategy, OnebitLambStrategy, ZeroOneAdamStrategy
from lightning_optim.model import ByteGPT, param_groups
from lightning_optim.onebit import OnebitAdam
from lightning_optim.train import lightning_arg
from tests.distributed import run_cli


def test_default_is_onebit_adam_on_two_processes(compose_train):
    cfg = compose_train()
    assert cfg.trainer.devices == 2
    strategy = lightning_arg(dict(cfg.strategy))
    assert type(strategy) is OnebitAdamStrategy
    assert 0 < strategy._knobs["freeze_step"] <= cfg.trainer.max_steps // 2  # compression reached by default
    assert compose_train("strategy=auto").trainer.devices == 1
    assert compose_train("trainer.devices=4").trainer.devices == 4


def test_overrides_of_the_onebit_knobs(compose_train):
    strategy = lightning_arg(dict(compose_train("strategy.freeze_step=50").strategy))
    assert strategy._knobs == {"freeze_step": 50, "auto_mask": True}  # auto_mask: the shipped config's
    auto = compose_train("strategy.freeze_step=auto", "strategy=onebit_lamb", "optimizer=fused_lamb")
    check_config(OmegaConf.to_container(auto, resolve=True))  # "auto" is a valid freeze_step
    assert lightning_arg(dict(auto.strategy))._knobs["freeze_step"] == "auto"
    assert lightning_arg(dict(compose_train("strategy.freeze_step=auto").strategy))._knobs["freeze_step"] == "auto"
    off = lightning_arg(dict(compose_train("strategy.auto_mask=false").strategy))
    assert off._knobs["auto_mask"] is False
    cfg = compose_train("optimizer=onebit_adam", "optimizer.freeze_step=50")  # already 1-bit: used as is
    optimizer = hydra.utils.instantiate(cfg.optimizer)(param_groups(ByteGPT(max_seq_len=8, n_layer=1, d_model=16)))
    assert type(optimizer) is OnebitAdam and optimizer.freeze_step == 50
    zero_one = lightning_arg(dict(compose_train("strategy=zero_one_adam", "strategy.local_step_clipper=8").strategy))
    assert type(zero_one) is ZeroOneAdamStrategy and zero_one._knobs["local_step_clipper"] == 8
    lamb = compose_train("strategy=onebit_lamb", "optimizer=fused_lamb")
    assert type(lightning_arg(dict(lamb.strategy))) is OnebitLambStrategy and lamb.trainer.devices == 2


def _run_job(tmp_path: Path, *overrides: str, world: int = 2) -> tuple[subprocess.CompletedProcess, dict, Path]:
    """The main job on ``world`` processes for 8 small steps (``python -m lightning_optim.train``, Lightning's
    launcher starting the other ranks); checks it trained, returns (process, summary, run dir)."""
    run_dir = tmp_path / "run"
    args = ["trainer=smoke", "trainer.max_steps=8", "trainer.val_check_interval=8", *overrides,
            "data.max_bytes=100000", "model.n_layer=1", "model.d_model=64", f"hydra.run.dir={run_dir}"]
    result = run_cli(args, cwd=tmp_path, env={**os.environ, "PYTHONWARNINGS": "ignore"}, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == world and summary["steps"] == 8
    assert summary["final_val_loss"] < summary["initial_val_loss"]
    return result, summary, run_dir


def test_cli_default_runs_two_processes_and_rank_0_writes(tmp_path: Path):
    result, summary, run_dir = _run_job(tmp_path, "strategy.freeze_step=4")
    comm = summary["comm"]
    assert comm["optimizer"] == "OnebitAdam" and comm["steps"] == 8 and comm["steps_without_ddp_allreduce"] == 4
    assert comm["compression_ratio"] > 1.8  # half the steps at ~32x less than fp32
    assert "bytes sent per rank" in result.stdout  # the printed table
    with open(run_dir / "metrics.csv", newline="") as handle:
        rows = [r for r in csv.DictReader(handle) if r.get("comm/bytes_sent")]
    assert len(rows) == 8
    # the stage switch: said once on the console and in train.log, marked in summary.json (and loss.png)
    switch = "lightning-optim: step 4: the 1-bit stage starts: OnebitAdam exchanges 1-bit compressed momentum"
    assert result.stdout.count(switch) == 1 and comm["stage_switch_step"] == 4
    assert "4 of 8 steps without DDP's fp32 allreduce, from step 4)" in result.stdout
    job_log = (run_dir / "train.log").read_text()  # our messages and Lightning's, time-stamped
    assert switch in job_log and "lightning-optim run summary" in job_log and "bytes sent per rank" in job_log
    assert "Initializing distributed: GLOBAL_RANK: 0" in job_log
    assert (run_dir / "loss.png").stat().st_size > 0
    # rank 1 ran in the same directory (its own log: Lightning's messages of that process) and wrote none of the outputs
    assert "GLOBAL_RANK: 1" in (run_dir / "train_ddp_process_1.log").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert len(list(tmp_path.rglob("summary.json"))) == 1 and len(list(tmp_path.rglob(".hydra"))) == 1


def test_cli_gradient_release_on_the_default_config_with_bf16_kahan(tmp_path: Path):
    """``gradient_release=true precision=bf16_kahan`` on the default config: the default clip and the default
    1-bit strategy give way (one note each), and two DDP processes train (the release hook steps every bucket;
    bf16 buckets reduce on gloo). An explicit clip still stops the job (tests/test_config_errors.py)."""
    result, summary, run_dir = _run_job(tmp_path, "precision=bf16_kahan", "gradient_release=true")
    config = summary["config"]
    assert config["gradient_release"] is True and config["trainer"]["gradient_clip_val"] is None
    assert config["strategy"]["_target_"] == "lightning.pytorch.strategies.DDPStrategy" and "comm" not in summary
    notes = [line for line in result.stdout.splitlines() if line.startswith("lightning-optim: gradient_release=true:")]
    assert len(notes) == 2, result.stdout  # rank 0 only
    job_log = (run_dir / "train.log").read_text()
    assert all(line in job_log for line in notes) and "lightning-optim run summary" in job_log


def test_cli_diloco_sends_one_all_reduce_per_sync_every_steps(tmp_path: Path):
    """strategy=diloco strategy.sync_every=4: no DDP all-reduce; 2 exchanges of the whole model in 8 steps."""
    result, summary, _ = _run_job(tmp_path, "strategy=diloco", "strategy.sync_every=4")
    comm = summary["comm"]
    assert comm["hook"] == "local" and comm["sync_every"] == 4 and comm["steps_without_ddp_allreduce"] == 8
    assert comm["compression_ratio"] == 4.0  # the fp32 ring all-reduce once per 4 steps instead of every step
    assert "(4.0x less; 8 of 8 steps without DDP's fp32 allreduce)" in result.stdout


def test_cli_final_loss_is_the_merged_model_s_after_streaming_diloco_s_last_merge(tmp_path: Path):
    """strategy=streaming_diloco (2 fragments, overlapped): the exchange started after step 8 merges at the end of
    the fit, after the validation scheduled at step 8; the job validates again, and its final loss is that of the
    merged model (another value than the scheduled validation's, logged after it)."""
    _, summary, run_dir = _run_job(tmp_path, "strategy=streaming_diloco", "strategy.sync_every=4",
                                   "strategy.fragments=2")
    with open(run_dir / "metrics.csv", newline="") as handle:
        losses = [float(r["val_loss"]) for r in csv.DictReader(handle) if r.get("val_loss")]
    scheduled, after_merge = losses[-2], losses[-1]  # the initial validation, step 8's, then the one after the merge
    assert len(losses) == 3 and summary["final_val_loss"] == pytest.approx(after_merge, rel=1e-6)
    assert after_merge != scheduled


def test_sparseloco_overrides_compose_into_the_strategy(compose_train):
    """strategy=diloco strategy.compressor=sparseloco strategy.density=0.03: the job's up-front check passes and the
    strategy holds SparseLoCo's settings, the outer ones resolved from the recipe (null in the config)."""
    from lightning_optim.distributed.diloco_checks import OUTER_DEFAULTS

    for option in ("diloco", "streaming_diloco", "ft_diloco"):
        cfg = compose_train(f"strategy={option}", "strategy.compressor=sparseloco", "strategy.density=0.03",
                            "strategy.bits=3")
        check_config(OmegaConf.to_container(cfg, resolve=True))
        kwargs = lightning_arg(dict(cfg.strategy))._diloco_kwargs
        assert (kwargs["compressor"], kwargs["density"], kwargs["bits"]) == ("sparseloco", 0.03, 3), option
        assert (kwargs["outer_lr"], kwargs["outer_momentum"], kwargs["nesterov"]) == OUTER_DEFAULTS["sparseloco"]


def test_cli_diloco_with_sparseloco_sends_its_compressed_exchanges(tmp_path: Path):
    """strategy=diloco strategy.compressor=sparseloco strategy.density=0.03: 2 exchanges of 3% of the model at 2
    bits in 8 steps; far fewer bytes than plain DiLoCo's 4x, and the loss falls (``_run_job``)."""
    _, summary, _ = _run_job(tmp_path, "strategy=diloco", "strategy.sync_every=4", "strategy.compressor=sparseloco",
                             "strategy.density=0.03")
    comm = summary["comm"]
    assert (comm["compressor"], comm["density"], comm["bits"]) == ("sparseloco", 0.03, 2)
    assert comm["hook"] == "local" and comm["steps_without_ddp_allreduce"] == 8
    assert comm["compression_ratio"] > 20 * 4.0, comm  # each exchange ~40x under the fp32 all-reduce, every 4 steps


def test_cli_onebit_fsdp_runs_hsdp_with_1bit_across_replicas(tmp_path: Path):
    """strategy=onebit_fsdp: 4 processes as 2 replicas x 2 shards; HSDP's fp32 all-reduce, then 1-bit."""
    result, summary, _ = _run_job(tmp_path, "strategy=onebit_fsdp", "strategy.freeze_step=4", world=4)
    comm = summary["comm"]
    assert comm["optimizer"] == "OnebitAdam" and comm["steps"] == 8 and comm["steps_without_ddp_allreduce"] == 4
    assert comm["baseline"] == "HSDP's fp32 all-reduce" and comm["compression_ratio"] > 1.8
    assert "step 4: the 1-bit stage starts: OnebitAdam exchanges 1-bit compressed momentum instead of HSDP's" \
        in result.stdout
