"""The built wheel ships the Hydra configs, and an installed (non-editable) copy runs the job."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import lightning_optim

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = Path(lightning_optim.__file__).parent / "conf"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(REPO)],
        check=True, capture_output=True, text=True, timeout=300,
    )
    (path,) = out.glob("lightning_optim-*.whl")
    return path


def test_wheel_contains_every_config(wheel: Path):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"lightning_optim/conf/{p.relative_to(CONF_DIR).as_posix()}" for p in CONF_DIR.rglob("*.yaml")}
    assert "lightning_optim/conf/train.yaml" in expected
    assert "lightning_optim/conf/__init__.py" in names
    missing = expected - names
    assert not missing, f"configs missing from the wheel: {sorted(missing)}"


def test_wheel_metadata(wheel: Path):
    archive = zipfile.ZipFile(wheel)
    (metadata_name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
    metadata = archive.read(metadata_name).decode()
    assert "Name: lightning-optim" in metadata
    assert "Requires-Python: >=3.10" in metadata
    entry_points = archive.read(metadata_name.replace("METADATA", "entry_points.txt")).decode()
    assert "lightning-optim-train = lightning_optim.train:main" in entry_points


@pytest.mark.slow
def test_installed_wheel_runs_the_job(wheel: Path, tmp_path: Path):
    """Install the wheel (not editable) into its own folder and train from another directory.

    ``--target`` + ``PYTHONPATH`` rather than a venv: the dependencies come from the running
    environment, wherever it lives, and the wheel's copy shadows any editable install.
    """
    target = tmp_path / "installed"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    env = {**os.environ, "PYTHONPATH": str(target), "PYTHONWARNINGS": "ignore"}
    location = subprocess.run([sys.executable, "-c", "import lightning_optim; print(lightning_optim.__file__)"],
                              cwd=workdir, env=env, check=True, capture_output=True, text=True).stdout
    assert location.startswith(str(target)), f"imported the wrong copy: {location}"
    command = [str(target / "bin" / "lightning-optim-train"), "trainer=smoke", "trainer.max_steps=2",
               "data.max_bytes=100000", "strategy=auto", "trainer.devices=1", "hydra.run.dir=run"]
    result = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (workdir / "run" / "summary.json").is_file()


def test_import_is_cheap():
    """``import lightning_optim`` must not pull in Lightning, Hydra, matplotlib or the training job."""
    heavy = ("lightning", "hydra", "matplotlib", "lightning_optim.train")
    code = f"import sys, lightning_optim; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_wheel_ships_the_kernel_sources(wheel: Path):
    """A non-editable install compiles its kernels from lightning_optim/ops/csrc (setup.py copies csrc/)."""
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        f"lightning_optim/ops/csrc/{p.relative_to(REPO / 'csrc').as_posix()}"
        for p in (REPO / "csrc").rglob("*")
        if p.suffix in {".h", ".cuh", ".cpp", ".cu"}
    }
    assert "lightning_optim/ops/csrc/bindings.cpp" in expected
    missing = expected - names
    assert not missing, f"kernel sources missing from the wheel: {sorted(missing)}"
