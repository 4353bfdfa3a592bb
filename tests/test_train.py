"""The main job trains for real: in-process with the smoke trainer, and through the Hydra CLI."""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import subprocess
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from lightning_optim.config_check import ConfigError, check_config
from lightning_optim.model import warmup_cosine
from lightning_optim.train import ProgressBar, build_trainer, last_epoch, release_defaults, run
from tests.distributed import run_cli

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# One process whatever the default strategy is: an in-process DDP launch would re-run pytest's argv.
FAST = ["trainer=smoke", "data.max_bytes=300000", "strategy=auto", "trainer.devices=1"]


def rows(metrics_csv: Path, name: str) -> list[float]:
    with open(metrics_csv, newline="") as handle:
        return [float(row[name]) for row in csv.DictReader(handle) if row.get(name)]


def test_smoke_run_trains_and_writes_outputs(compose_train, tmp_path: Path, caplog):
    cfg = compose_train(*FAST)
    with caplog.at_level(logging.INFO, logger="lightning_optim.train"):
        summary = run(cfg, tmp_path)

    train_losses = rows(tmp_path / "metrics.csv", "train_loss")
    val_losses = rows(tmp_path / "metrics.csv", "val_loss")
    assert len(train_losses) == cfg.trainer.max_steps  # smoke logs every step
    assert len(val_losses) == 3  # before training, and every val_check_interval steps
    assert all(math.isfinite(v) for v in train_losses + val_losses)
    assert val_losses[0] > 5.0  # untrained: close to ln(256) = 5.55
    assert val_losses[-1] < val_losses[0] - 0.5, f"validation loss barely moved: {val_losses}"
    assert train_losses[-1] < train_losses[0]

    assert (tmp_path / "loss.png").read_bytes().startswith(PNG_MAGIC)
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["initial_val_loss"] == pytest.approx(val_losses[0])
    assert saved["final_val_loss"] == pytest.approx(val_losses[-1])
    assert saved["final_train_loss"] == pytest.approx(train_losses[-1])
    assert saved["steps"] == cfg.trainer.max_steps
    assert saved["tokens"] == cfg.trainer.max_steps * cfg.data.batch_size * cfg.data.seq_len
    assert saved["train_tokens_per_sec"] > 0 and saved["wall_time_s"] > 0
    assert saved["num_params"] == summary["num_params"] > 100_000
    assert saved["config"]["data"]["seed"] == cfg.seed  # resolved, not "${seed}"
    assert saved["config"]["optimizer"]["_target_"] == cfg.optimizer._target_
    assert "val loss" in caplog.text  # the summary table goes through logging (console and train.log under Hydra)


def test_final_validation_runs_when_the_schedule_misses_the_last_step(compose_train, tmp_path: Path):
    cfg = compose_train(*FAST, "trainer.max_steps=7", "trainer.val_check_interval=5", "scheduler=null")
    summary = run(cfg, tmp_path)
    with open(tmp_path / "metrics.csv", newline="") as handle:
        val_steps = [int(r["step"]) for r in csv.DictReader(handle) if r.get("val_loss")]
    assert len(val_steps) == 3 and val_steps[-1] == 7  # initial, after step 5, final
    assert summary["final_val_loss"] == pytest.approx(rows(tmp_path / "metrics.csv", "val_loss")[-1])


def test_user_text_file(compose_train, tmp_path: Path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("to be or not to be, that is the question. " * 400)
    cfg = compose_train(*FAST, "data=text", f"data.path={corpus}", "trainer.max_steps=10")
    summary = run(cfg, tmp_path / "out")
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 1.0  # repetitive text is easy


def _plain(compose_train, *overrides: str) -> dict:
    return OmegaConf.to_container(compose_train(*overrides), resolve=True)


def test_gradient_release_on_the_default_config_drops_what_cannot_release(compose_train):
    """``gradient_release=true`` alone: the default trainer's clip and the default 1-bit strategy give way
    (one note each); what the command line or a config file chose stays, and conflicts as before."""
    cfg = _plain(compose_train, "gradient_release=true")
    notes = release_defaults(cfg, ["gradient_release=true"])
    assert len(notes) == 2 and "gradient_clip_val=1.0 is dropped" in notes[0] and "strategy=ddp" in notes[1]
    assert cfg["trainer"]["gradient_clip_val"] is None and cfg["trainer"]["devices"] == 2
    assert cfg["strategy"]["_target_"] == "lightning.pytorch.strategies.DDPStrategy"
    check_config(cfg)  # now a valid release config
    one = _plain(compose_train, "gradient_release=true", "strategy=auto", "trainer.devices=1")
    assert len(release_defaults(one, ["gradient_release=true", "strategy=auto", "trainer.devices=1"])) == 1
    check_config(one)

    chosen = {  # overrides -> the conflict check_config still reports
        ("trainer.gradient_clip_val=1.0", "strategy=ddp"): "conflicts with trainer.gradient_clip_val=1.0",
        ("++trainer.gradient_clip_val=1.0",): "conflicts with trainer.gradient_clip_val=1.0",
        ("strategy=onebit_adam",): "conflicts with the 1-bit strategy",
        ("strategy.freeze_step=50",): "conflicts with the 1-bit strategy",
    }
    for overrides, conflict in chosen.items():
        cfg = _plain(compose_train, "gradient_release=true", *overrides)
        release_defaults(cfg, ["gradient_release=true", *overrides])
        with pytest.raises(ConfigError, match=f"^gradient_release: {conflict}"):
            check_config(cfg)
    from_a_file = _plain(compose_train, "gradient_release=true", "strategy=ddp")
    from_a_file["trainer"]["gradient_clip_val"] = 0.5  # not the shipped default: someone's trainer option chose it
    assert release_defaults(from_a_file, ["gradient_release=true", "strategy=ddp"]) == []
    untouched = _plain(compose_train, "gradient_release=true")
    assert release_defaults(untouched, None) == [] and untouched == _plain(compose_train, "gradient_release=true")
    assert release_defaults(_plain(compose_train), []) == []  # no release: nothing changes


def test_progress_bar_counts_the_epochs_max_steps_spans(compose_train, tmp_path: Path):
    """Lightning sets max_epochs=-1 when max_steps bounds the run and its bar read "Epoch 0/-2"."""
    cfg = _plain(compose_train, *FAST, "trainer.enable_progress_bar=true", "trainer.max_steps=400")
    trainer = build_trainer(cfg, tmp_path, callbacks=[])
    bar = trainer.progress_bar_callback
    assert isinstance(bar, ProgressBar)
    trainer.fit_loop.max_batches = 70  # what fit finds: batches per epoch
    bar._trainer = trainer
    assert bar._get_train_description(0).strip() == "Epoch 0/5"  # 400 steps of 70 batches: epochs 0..5
    trainer.fit_loop.max_epochs = -1  # as fit sets it
    assert last_epoch(trainer) == 5
    trainer.accumulate_grad_batches = 4  # 18 steps per epoch (the last 2 batches step too): epochs 0..22
    assert last_epoch(trainer) == 22
    trainer.accumulate_grad_batches = 1
    trainer.fit_loop.max_epochs = 3  # an explicit +trainer.max_epochs=3 ends it first
    assert last_epoch(trainer) == 2
    trainer.fit_loop.max_epochs, trainer.fit_loop.max_batches = -1, float("inf")  # unknown epoch length
    assert last_epoch(trainer) is None and bar._get_train_description(1).strip() == "Epoch 1"
    off = build_trainer(_plain(compose_train, *FAST), tmp_path, callbacks=[])  # smoke: no bar at all
    assert off.progress_bar_callback is None


def test_warmup_cosine_schedule():
    factors = [warmup_cosine(step, warmup_steps=10, total_steps=110, min_lr_ratio=0.1) for step in range(120)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(factors[9:], factors[10:]))  # never rises after warmup
    assert factors[60] == pytest.approx(0.55)  # half way down the cosine
    assert factors[110] == pytest.approx(0.1) and factors[119] == pytest.approx(0.1)


def test_cli_sweep_from_another_directory(compose_train, tmp_path: Path):
    """``-m`` runs one job per value, each writing its own outputs; cwd is not the repository."""
    args = ["-m", "optimizer=adamw,sgd", *FAST, "trainer.max_steps=3", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    result = run_cli(args, cwd=tmp_path, env=env, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    summaries = sorted((tmp_path / "sweep").glob("*/summary.json"))
    assert len(summaries) == 2
    targets = {json.loads(p.read_text())["config"]["optimizer"]["_target_"] for p in summaries}
    assert targets == {compose_train(f"optimizer={name}").optimizer._target_ for name in ("adamw", "sgd")}


def test_cli_reports_bad_data_path(tmp_path: Path):
    args = [*FAST, f"data.path={tmp_path / 'missing'}", f"hydra.run.dir={tmp_path / 'run'}"]
    result = run_cli(args, cwd=tmp_path, timeout=120)
    assert result.returncode != 0
    assert "data.path=" in result.stderr and "does not exist" in result.stderr


def _cli(*args: str, cwd: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    return run_cli(list(args), cwd=cwd, timeout=timeout)


def test_users_tree_beside_the_shipped_one(tmp_path: Path):
    """``--config-dir`` adds a user's tree to the shipped one: its primary config (``--config-name``)
    extends train.yaml and picks an optimizer by its deprecated name; its own option extends ours."""
    tree = tmp_path / "mine"
    (tree / "optimizer").mkdir(parents=True)
    (tree / "optimizer" / "slow_sgd.yaml").write_text("defaults:\n  - sgd\n  - _self_\nlr: 0.01\n")
    (tree / "experiment.yaml").write_text(
        "defaults:\n  - train\n  - override optimizer: signsgd\n  - _self_\nseed: 7\noptimizer:\n  lr: 0.001\n"
    )
    done = _cli("--config-dir", str(tree), "--config-name", "experiment", *FAST, "trainer.max_steps=2",
                "hydra.run.dir=run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "optimizer=signsgd is a deprecated name; use optimizer=sign_sgd" in done.stderr  # FutureWarning
    config = json.loads((tmp_path / "run" / "summary.json").read_text())["config"]
    assert config["seed"] == 7 and config["optimizer"]["lr"] == 0.001
    assert config["optimizer"]["_target_"] == "lightning_optim.SignSGD"

    printed = _cli("--config-dir", str(tree), "optimizer=slow_sgd", "--cfg", "job", cwd=tmp_path, timeout=120)
    assert printed.returncode == 0, printed.stderr[-3000:]
    assert "_target_: lightning_optim.SGD" in printed.stdout and "lr: 0.01" in printed.stdout


def test_config_path_replaces_the_shipped_tree(tmp_path: Path):
    (tmp_path / "own").mkdir()
    (tmp_path / "own" / "solo.yaml").write_text("mine: 1\n")
    printed = _cli("--config-path", str(tmp_path / "own"), "--config-name", "solo", "--cfg", "job", cwd=tmp_path,
                   timeout=120)
    assert printed.returncode == 0, printed.stderr[-3000:]
    assert printed.stdout.strip() == "mine: 1"
