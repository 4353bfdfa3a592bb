"""The CUDA multi-tensor driver's plan and per-thread work (csrc/cuda/multi_tensor_body.h), run on the
host thread by thread against the plain element loop of the CPU kernels: bitwise-equal results for every
optimizer op, fp32 and 16-bit lists, aligned and unaligned tensors, tails, several launches.
No GPU needed: the GPU-only parts left are the 16-byte accesses themselves and the block sums."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CXX = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("g++")


@pytest.mark.skipif(CXX is None, reason="no C++ compiler")
def test_cuda_driver_emulation_matches_element_loop(tmp_path):
    binary = tmp_path / "cuda_driver_emulation"
    # -O1: half of -O2's compile time (5 s against 10 s here) for the same run time; no flag that changes
    # floating-point results (no fast-math, no contraction), so both sides compare bit for bit as at -O2
    build = subprocess.run([CXX, "-std=c++17", "-O1", "-ffp-contract=off", "-Wno-unknown-pragmas",
                            f"-I{ROOT / 'csrc'}", str(ROOT / "tests/ops/cuda_driver_emulation.cpp"), "-o", str(binary)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "all cases equal" in run.stdout
