"""Ships the kernel sources (csrc/) inside the wheel as lightning_optim/ops/csrc.

Everything else is in pyproject.toml; this file only adds csrc/ to the built package, so an
installed (non-editable) lightning-optim can still compile its kernels on first use.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

SOURCE_SUFFIXES = {".h", ".cuh", ".cpp", ".cu"}


class BuildPyWithKernelSources(build_py):
    def run(self) -> None:
        super().run()
        source_root = Path(__file__).parent / "csrc"
        target_root = Path(self.build_lib) / "lightning_optim" / "ops" / "csrc"
        for path in source_root.rglob("*"):
            if path.suffix in SOURCE_SUFFIXES:
                target = target_root / path.relative_to(source_root)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target)


setup(cmdclass={"build_py": BuildPyWithKernelSources})
