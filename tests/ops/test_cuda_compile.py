"""The CUDA sources compile with nvcc alone (no GPU, no torch headers).

Here only the fast file (onebit_cuda.cu, a few seconds); the full set (optim_cuda.cu takes ~40 s
per architecture) is a separate CI step, see docs/guides/kernels.md. LIGHTNING_OPTIM_NVCC_ALL=1 checks
every .cu file here too.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[2] / "csrc"
NVCC = shutil.which("nvcc")
FILES = ["onebit_cuda.cu"] + (["optim_cuda.cu"] if os.environ.get("LIGHTNING_OPTIM_NVCC_ALL") else [])


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
@pytest.mark.parametrize("name", FILES)
def test_nvcc_compiles(name, tmp_path):
    cmd = [NVCC, "-std=c++17", "-O3", "--expt-relaxed-constexpr", "-arch=sm_90", "-c", str(CSRC / "cuda" / name),
           "-o", str(tmp_path / (name + ".o"))]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
