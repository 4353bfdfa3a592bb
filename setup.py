"""Ships the kernel sources (csrc/) and the Hydra configs (conf/) inside the wheel.

Everything else is in pyproject.toml. The repository's top-level csrc/ and conf/ are the one source;
build_py copies them to lightning_optim/ops/csrc and lightning_optim/conf in the built package, so an
installed (non-editable) lightning-optim compiles its kernels on first use and runs the main job.
MANIFEST.in puts both folders in the sdist, so a wheel built from it has them too.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent
# source folder -> (folder inside the built package, suffixes copied)
SHIPPED = {
    "csrc": (Path("lightning_optim", "ops", "csrc"), {".h", ".cuh", ".cpp", ".cu"}),
    "conf": (Path("lightning_optim", "conf"), {".yaml"}),
}


class BuildPyWithSourcesAndConfigs(build_py):
    def run(self) -> None:
        super().run()
        for source, (destination, suffixes) in SHIPPED.items():
            source_root = ROOT / source
            if not source_root.is_dir():  # e.g. an sdist made without MANIFEST.in: fail, not a broken wheel
                raise FileNotFoundError(f"{source_root} is missing: the wheel would ship without {source}/")
            target_root = Path(self.build_lib) / destination
            for path in source_root.rglob("*"):
                if path.suffix in suffixes:
                    target = target_root / path.relative_to(source_root)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(path, target)


setup(cmdclass={"build_py": BuildPyWithSourcesAndConfigs})
