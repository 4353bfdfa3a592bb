#!/usr/bin/env bash
# Command-line overrides and a Hydra sweep of the main job (a few minutes on 2 CPU cores).
# Each job of the sweep writes metrics.csv, loss.png and summary.json under multirun/<date>/<time>/<n>/.
set -euo pipefail

# One run: another optimizer and learning rate, a shorter schedule, this README as the corpus.
# SGD has no 1-bit strategy, so this run is one plain process (strategy=auto, one device).
python -m lightning_optim.train optimizer=sgd optimizer.lr=0.1 strategy=auto trainer.devices=1 trainer.max_steps=40 \
    trainer.val_check_interval=20 data.path="$(dirname "$0")/../README.md" data.seq_len=64

# A sweep (-m): 2 optimizers x 2 learning rates, short single-process runs, one directory per job.
python -m lightning_optim.train -m optimizer=adamw,adam optimizer.lr=1e-3,3e-3 strategy=auto trainer.devices=1 \
    trainer.max_steps=30 trainer.val_check_interval=15 trainer.enable_progress_bar=false

# Final validation loss of each job of the latest sweep.
latest=$(ls -d multirun/*/* | sort | tail -n 1)
python - "$latest" <<'PY'
import json, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("*/summary.json")):
    s = json.loads(path.read_text())
    opt = s["config"]["optimizer"]
    print(f"{opt['_target_']:>20} lr={opt['lr']:<6} val loss {s['initial_val_loss']:.3f} -> {s['final_val_loss']:.3f}")
PY
