"""The sdist and the wheel built from it ship the Hydra configs and kernel sources; an installed
(non-editable) copy runs the job."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests import torch_alone

REPO = Path(__file__).resolve().parents[1]
TRAINING = REPO / "tests" / "torch_alone_training.py"
KERNEL_SUFFIXES = {".h", ".cuh", ".cpp", ".cu"}


def repo_files(folder: str, suffixes: set[str]) -> set[str]:
    """Paths (relative to the repository) of ``folder``'s files with these suffixes: the root conf/ and
    csrc/ are the one source; the wheel carries them as lightning_optim/conf and lightning_optim/ops/csrc."""
    return {p.relative_to(REPO).as_posix() for p in (REPO / folder).rglob("*") if p.suffix in suffixes}


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``python -m build``: an sdist, then a wheel built from that sdist (as pip builds one from PyPI)."""
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(REPO)],
                   check=True, capture_output=True, text=True, timeout=300)
    return out


@pytest.fixture(scope="module")
def wheel(dist: Path) -> Path:
    (path,) = dist.glob("lightning_optim-*.whl")
    return path


@pytest.fixture(scope="module")
def sdist(dist: Path) -> Path:
    (path,) = dist.glob("lightning_optim-*.tar.gz")
    return path


def test_sdist_contains_the_configs_and_kernel_sources(sdist: Path):
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    expected = repo_files("conf", {".yaml"}) | repo_files("csrc", KERNEL_SUFFIXES)
    assert "conf/train.yaml" in expected and "csrc/bindings.cpp" in expected
    missing = expected - names
    assert not missing, f"missing from the sdist (MANIFEST.in): {sorted(missing)}"


def test_wheel_contains_every_config(wheel: Path):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"lightning_optim/{path}" for path in repo_files("conf", {".yaml"})}
    assert "lightning_optim/conf/train.yaml" in expected
    missing = expected - names
    assert not missing, f"configs missing from the wheel: {sorted(missing)}"
    assert not [n for n in names if n.startswith("conf/")], "a top-level conf/ would land in site-packages"


def test_wheel_ships_the_type_markers(wheel: Path):
    """PEP 561: a type checker reads an installed package's annotations only where it ships ``py.typed``."""
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = {"lightning_optim/py.typed", "accel_plugins/py.typed"} - names
    assert not missing, f"type markers missing from the wheel: {sorted(missing)}"


def test_wheel_metadata(wheel: Path):
    archive = zipfile.ZipFile(wheel)
    (metadata_name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
    metadata = archive.read(metadata_name).decode()
    assert "Name: lightning-optim" in metadata
    assert "Requires-Python: >=3.10" in metadata
    assert "License-Expression: Apache-2.0" in metadata
    licences = {n.rsplit("/", 1)[1] for n in archive.namelist() if ".dist-info/licenses/" in n}
    assert licences == {"LICENSE", "NOTICE"}
    assert archive.read(metadata_name.replace("METADATA", "licenses/LICENSE")) == (REPO / "LICENSE").read_bytes()
    # the core needs torch alone; every framework comes with an extra
    required = sorted(line.split(":", 1)[1].strip() for line in metadata.splitlines()
                      if line.startswith("Requires-Dist:") and "extra ==" not in line)
    assert required == ["ninja", "torch>=2.4"]
    for extra, package in (("lightning", "lightning"), ("train", "hydra-core"), ("hf", "transformers"),
                           ("dev", "pytest")):
        assert any(line.startswith(f"Requires-Dist: {package}") and f'extra == "{extra}"' in line
                   for line in metadata.splitlines()), (extra, package)
    entry_points = archive.read(metadata_name.replace("METADATA", "entry_points.txt")).decode()
    assert "lightning-optim-train = lightning_optim.train:main" in entry_points


@pytest.mark.slow
def test_installed_wheel_runs_the_job(wheel: Path, tmp_path: Path):
    """Install the wheel (not editable) into its own folder and train from another directory through its console
    script (``python -m lightning_optim.train`` is the same module, which the other main-job tests start).

    ``--target`` + ``PYTHONPATH`` rather than a venv: the dependencies come from the running
    environment, wherever it lives, and the wheel's copy shadows any editable install. Which copy ran is in the
    run's own record: Hydra's ``hydra.yaml`` names the config folder the job read, which the job finds beside its
    own files (``lightning_optim.conf_dir``).
    """
    target = tmp_path / "installed"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    env = {**os.environ, "PYTHONPATH": str(target), "PYTHONWARNINGS": "ignore"}
    fast = ["trainer=smoke", "trainer.max_steps=2", "data.max_bytes=100000", "strategy=auto", "trainer.devices=1",
            "optimizer=sign_sgd"]
    script = [str(target / "bin" / "lightning-optim-train"), *fast, "hydra.run.dir=run"]
    job = subprocess.run(script, cwd=workdir, env=env, capture_output=True, text=True, timeout=240)
    assert job.returncode == 0, job.stderr[-3000:]
    assert (workdir / "run" / "summary.json").is_file()
    hydra = OmegaConf.load(workdir / "run" / ".hydra" / "hydra.yaml").hydra
    (main_source,) = [s.path for s in hydra.runtime.config_sources if s.provider == "main"]
    assert Path(main_source) == target / "lightning_optim" / "conf", f"read the wrong configs: {main_source}"
    assert OmegaConf.load(workdir / "run" / ".hydra" / "config.yaml").optimizer._target_ == "lightning_optim.SignSGD"


def test_import_is_cheap_without_lightning():
    """Where Lightning is not installed (here: hidden from the import system), ``import lightning_optim`` pulls
    in no framework, no plot library, not the training job and not ``torch._dynamo`` (a traced step imports it;
    seconds of every plain-torch process's start otherwise); nor do ``accel_plugins`` or the framework-free names
    of ``lightning_optim.data``/``.model`` (what Accelerate and HF Trainer scripts import), every one of them.
    Where Lightning is installed, ``import lightning_optim`` imports it to register the strategy names
    (tests/lightning/test_registry.py)."""
    from lightning_optim import data, model

    heavy = ("lightning", "pytorch_lightning", "hydra", "matplotlib", "transformers", "accelerate",
             "lightning_optim.train", "torch._dynamo")
    imports = [f"from lightning_optim.{package.__name__.rsplit('.', 1)[1]} import {name}"
               for package in (data, model) for name in package.__all__ if name not in package._LIGHTNING_NAMES]
    code = "; ".join(["import sys", "sys.modules.update(lightning=None, pytorch_lightning=None)",
                      "import lightning_optim, accel_plugins", *imports,
                      f"print(sorted(m for m in {heavy!r} if sys.modules.get(m) is not None))"])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_lightning_classes_load_on_first_use():
    """``lightning_optim.data.ByteDataModule`` and ``lightning_optim.model.LanguageModel`` (the names configs and
    users give) resolve to the classes of the modules that import Lightning; ``dir()`` lists them."""
    import lightning.pytorch as pl

    from lightning_optim import data, model
    from lightning_optim.data.datamodule import ByteDataModule
    from lightning_optim.model.language_model import LanguageModel

    assert data.ByteDataModule is ByteDataModule and issubclass(ByteDataModule, pl.LightningDataModule)
    assert model.LanguageModel is LanguageModel and issubclass(LanguageModel, pl.LightningModule)
    assert "ByteDataModule" in dir(data) and "LanguageModel" in dir(model)
    with pytest.raises(AttributeError, match="has no attribute 'ByteDataModul'"):
        data.ByteDataModul  # noqa: B018 - a typo still fails as it would without lazy names


def test_wheel_ships_the_kernel_sources(wheel: Path):
    """A non-editable install compiles its kernels from lightning_optim/ops/csrc (setup.py copies csrc/)."""
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"lightning_optim/ops/{path}" for path in repo_files("csrc", KERNEL_SUFFIXES)}
    assert "lightning_optim/ops/csrc/bindings.cpp" in expected
    missing = expected - names
    assert not missing, f"kernel sources missing from the wheel: {sorted(missing)}"


@pytest.fixture(scope="module")
def torch_alone_python(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv holding torch (and what torch requires) only, with the wheel installed into it by pip --no-deps."""
    python = torch_alone.make(tmp_path_factory.mktemp("torch_alone") / "venv")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)],
                   check=True, capture_output=True, timeout=300)
    return python


def _run_torch_alone(python: Path, args: list[str], cwd: Path) -> list[dict]:
    """Run the training script (copied to ``cwd``: beside tests/ its folder would shadow real packages, e.g.
    tests/lightning as ``lightning``) with the environment's own interpreter; the reports of its processes."""
    shutil.copy(TRAINING, cwd / TRAINING.name)
    args = [cwd / TRAINING.name if arg == str(TRAINING) else arg for arg in args]
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONWARNINGS"] = "ignore"  # torch warns that numpy is missing; the output is one JSON line per process
    out = subprocess.run([str(python), *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    files = sorted(cwd.glob("report_rank*.json"))
    return [json.loads(f.read_text()) for f in files] or [json.loads(out.stdout.strip().splitlines()[-1])]


def test_the_wheel_beside_torch_alone_trains_and_names_the_extras(torch_alone_python: Path, tmp_path: Path):
    """``pip install lightning-optim`` without extras: AdamW steps as torch.optim.AdamW does, no framework is
    imported, and each adapter refuses with an ImportError naming the extra that installs its framework."""
    (report,) = _run_torch_alone(torch_alone_python, [str(TRAINING), "single"], tmp_path)
    assert report["frameworks_imported"] == [] and report["heavy_after_import"] == []
    assert report["max_gap_to_torch"] < 1e-5 and report["last_loss"] < report["first_loss"]
    refusals = report["refusals"]
    for target, extra in (("lightning_optim.lightning", "lightning"), ("accel_plugins", "hf"),
                          ("lightning_optim.train", "train"), ("lightning_optim.data:ByteDataModule", "lightning"),
                          ("lightning_optim:OnebitAdamStrategy", "lightning")):
        assert refusals[target] is not None and f"pip install 'lightning-optim[{extra}]'" in refusals[target], target


@pytest.mark.slow
def test_the_wheel_beside_torch_alone_runs_onebit_adam_and_diloco_on_two_ranks(torch_alone_python: Path,
                                                                                 tmp_path: Path):
    """torchrun (torch's own) starts two gloo ranks: OnebitAdam goes past its freeze step (1-bit exchanges
    counted) with the ranks' params equal, and DiLoCo past its syncs leaves one model on both ranks."""
    reports = _run_torch_alone(torch_alone_python, ["-m", "torch.distributed.run", "--standalone",
                                                    "--nproc_per_node", "2", str(TRAINING), "ranks"], tmp_path)
    assert sorted(r["rank"] for r in reports) == [0, 1]
    for report in reports:
        assert report["frameworks_imported"] == []
        assert report["onebit_compressed_calls"] >= 5  # steps 4-8 run 1-bit (freeze_step=3)
        assert report["onebit_spread"] == 0.0
        assert report["diloco_bytes"] > 0 and report["diloco_spread"] == 0.0
