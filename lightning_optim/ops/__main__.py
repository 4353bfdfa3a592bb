"""``python -m lightning_optim.ops build``: compile the kernels ahead of time and say where."""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_optim.ops", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="compile the extension now (CPU, plus CUDA when torch and nvcc have it)")
    b.add_argument("--verbose", action="store_true", help="show the compiler commands")
    b.add_argument("--force", action="store_true", help="retry after a failure recorded in this process")
    args = parser.parse_args(argv)

    from lightning_optim.ops import _loader

    started = time.perf_counter()
    try:
        module = _loader.build(verbose=args.verbose, force=args.force)
    except _loader.BuildError as exc:
        print(f"lightning-optim: build failed: {exc}", file=sys.stderr)
        return 1
    backends = ["cpu", "cuda"] if module.with_cuda() else ["cpu"]
    print(f"lightning-optim: kernels built in {module.__file__}")
    print(f"lightning-optim: backends: {', '.join(backends)} (+ torch fallback); {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
