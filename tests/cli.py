"""The main job (and any module) run as a user runs it: ``python -m <module> <args>`` in a new interpreter.

``run_cli(args, cwd=...)`` is ``python -m lightning_optim.train *args``; both return what
``subprocess.run(command, capture_output=True, text=True)`` returns, and a timeout kills the run and every
process it started (Lightning's launched ranks included).
"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.distributed import run_process

JOB = "lightning_optim.train"


def run_cli(args: list[str], *, cwd: str | os.PathLike, env: dict[str, str] | None = None,
            timeout: float = 240) -> subprocess.CompletedProcess:
    """``python -m lightning_optim.train *args`` in ``cwd``."""
    return run_module(JOB, args, cwd=cwd, env=env, timeout=timeout)


def run_module(module: str, args: list[str], *, cwd: str | os.PathLike, env: dict[str, str] | None = None,
               timeout: float = 240) -> subprocess.CompletedProcess:
    """``python -m <module> *args`` in ``cwd`` (environment: ``env``, default this process's)."""
    return run_process([sys.executable, "-m", module, *map(str, args)], cwd=cwd, env=env, timeout=timeout)
