"""The main job trains for real: in-process with the smoke trainer, and through the Hydra CLI."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_optim.model import warmup_cosine
from lightning_optim.train import run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# One process whatever the default strategy is: an in-process DDP launch would re-run pytest's argv.
FAST = ["trainer=smoke", "data.max_bytes=300000", "strategy=auto", "trainer.devices=1"]


def rows(metrics_csv: Path, name: str) -> list[float]:
    with open(metrics_csv, newline="") as handle:
        return [float(row[name]) for row in csv.DictReader(handle) if row.get(name)]


def test_smoke_run_trains_and_writes_outputs(compose_train, tmp_path: Path, capsys):
    cfg = compose_train(*FAST)
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
    assert "val loss" in capsys.readouterr().out  # the printed table


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


def test_warmup_cosine_schedule():
    factors = [warmup_cosine(step, warmup_steps=10, total_steps=110, min_lr_ratio=0.1) for step in range(120)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(factors[9:], factors[10:]))  # never rises after warmup
    assert factors[60] == pytest.approx(0.55)  # half way down the cosine
    assert factors[110] == pytest.approx(0.1) and factors[119] == pytest.approx(0.1)


def test_cli_sweep_from_another_directory(compose_train, tmp_path: Path):
    """``-m`` runs one job per value, each writing its own outputs; cwd is not the repository."""
    command = [sys.executable, "-m", "lightning_optim.train", "-m", "optimizer=adamw,sgd",
               *FAST, "trainer.max_steps=3", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    summaries = sorted((tmp_path / "sweep").glob("*/summary.json"))
    assert len(summaries) == 2
    targets = {json.loads(p.read_text())["config"]["optimizer"]["_target_"] for p in summaries}
    assert targets == {compose_train(f"optimizer={name}").optimizer._target_ for name in ("adamw", "sgd")}


def test_cli_reports_bad_data_path(tmp_path: Path):
    command = [sys.executable, "-m", "lightning_optim.train", *FAST,
               f"data.path={tmp_path / 'missing'}", f"hydra.run.dir={tmp_path / 'run'}"]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "data.path=" in result.stderr and "does not exist" in result.stderr


def _cli(*args: str, cwd: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lightning_optim.train", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


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
