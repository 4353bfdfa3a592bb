"""The first ``step()``'s memory of each of our optimizers next to its torch.optim counterpart.

Each of our optimizers (``--optimizers``) and its torch.optim counterpart (the same states: AdamW,
Adam, SGD and RAdam; FusedAdam/CPUAdam -> AdamW, FusedSGD -> SGD; the others are compared with
torch's AdamW by what each needs beyond its own states), in a fresh process, on two models
(``--models``): ``gpt`` (``ByteGPT``, ~50M params, ``--quick``: ~12M, after one forward/backward on
random byte ids, batch 2 x sequence 64) and ``tensors`` (50 plain Parameters of 1M elements, random
grads). The rise = the peak during the first ``opt.step()`` (ru_maxrss reset right before it; a
thread reading /proc/self/statm every ~1 ms as a cross-check; on CUDA max_memory_allocated) minus
the memory held before the optimizer was built. Goal (printed, never asserted): rise - own
states <= torch's rise - its states + 2% of our states. ``--code-root DIR`` imports the library from
another checkout (e.g. a worktree of an older commit: the "before" figure); ``LIGHTNING_OPTIM_BACKEND=torch``
in the environment runs our optimizers on the torch path.

Run it through ``benchmarks/memory.py`` (``--first-step``: only this; ``--no-first-step``: without it):

    python benchmarks/memory.py --first-step --models tensors --optimizers AdamW,Lion

This file's own command line is the child process that ``run_first_step`` spawns, one per optimizer
(``--first-step-child ours:AdamW|torch:AdamW --model gpt|tensors --size full|quick --threads N``;
children run with ``MALLOC_MMAP_THRESHOLD_=65536`` unless set, so freed tensors go back to the OS).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_probe import (  # noqa: E402  (benchmarks/memory_probe.py)
    MB, MET, SEQ, SIZES, _batch, _loss, _now, _peak, _reset_peak, _result, _tensor_bytes)

import lightning_optim  # noqa: E402
from lightning_optim.model import ByteGPT  # noqa: E402

_SCRIPT = str(Path(__file__).resolve())  # the child's path, absolute: --code-root runs it from another cwd

# ours -> (kwargs, torch.optim counterpart holding the same states, or None: compared with torch's AdamW by what
# each needs beyond its own states). lr 1e-3 everywhere; torch's counterparts get the same kwargs.
FIRST_STEP = {
    "AdamW": (dict(weight_decay=0.01), "AdamW"), "Adam": ({}, "Adam"), "SGD": (dict(momentum=0.9), "SGD"),
    "RAdam": ({}, "RAdam"), "FusedAdam": (dict(weight_decay=0.01), "AdamW"),
    "CPUAdam": (dict(weight_decay=0.01), "AdamW"), "FusedSGD": (dict(momentum=0.9), "SGD"),
    "Lamb": (dict(weight_decay=0.01), None), "FusedLamb": (dict(weight_decay=0.01), None),
    "Lars": (dict(momentum=0.9), None), "Lion": ({}, None), "Adan": ({}, None), "Ranger": ({}, None),
    "StableAdamW": ({}, None), "SignSGD": (dict(momentum=0.9), None), "SparsifiedSGD": ({}, None),
}
TORCH_FIRST = {"AdamW": dict(weight_decay=0.01), "Adam": {}, "SGD": dict(momentum=0.9), "RAdam": {}}
TENSORS, TENSOR_NUMEL, GOAL = 50, 2**20, 0.02  # "50 tensors of 1M params"; goal: <= torch's + 2% of the states


class _Sampler(threading.Thread):
    """The largest RSS seen in /proc/self/statm, read every ~1 ms (a cross-check of ru_maxrss: it misses
    peaks shorter than a period, and kernels that hold the GIL delay it)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.done, self.peak, self.samples = threading.Event(), 0, 0

    def run(self) -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        with open("/proc/self/statm", "rb", buffering=0) as f:
            while not self.done.is_set():
                f.seek(0)
                self.peak, self.samples = max(self.peak, int(f.read().split()[1]) * page), self.samples + 1
                time.sleep(0.001)


def _first_step_params(model: str, size: str, device: str) -> list[torch.Tensor]:
    """The params of ``model`` ("gpt" or "tensors"), each with a ``.grad``."""
    torch.manual_seed(0)
    if model == "gpt":
        net = ByteGPT(max_seq_len=SEQ, **SIZES[size]).to(device)
        _loss(net, *_batch(0, device)).backward()
        return list(net.parameters())
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(TENSOR_NUMEL, generator=gen).to(device)) for _ in range(TENSORS)]
    for p in params:
        p.grad = torch.randn(TENSOR_NUMEL, generator=gen).to(device)
    return params


def first_step_child(label: str, model: str, size: str, threads: int) -> None:
    """One optimizer's first ``step()``: the rise of the peak over the memory held before it was built."""
    import gc
    import warnings

    torch.set_num_threads(threads)
    sys.setswitchinterval(0.001)  # let the sampler in between the step's Python calls
    cuda = torch.cuda.is_available()
    params = _first_step_params(model, size, "cuda" if cuda else "cpu")
    side, name = label.split(":")
    if side == "torch":
        make = lambda: getattr(torch.optim, name)(params, lr=1e-3, **TORCH_FIRST[name])  # noqa: E731
    else:
        make = lambda: getattr(lightning_optim, name)(params, lr=1e-3, **FIRST_STEP[name][0])  # noqa: E731
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
    before = _now(cuda)
    opt = make()
    built = _now(cuda) - before
    sampler = None if cuda else _Sampler()
    if sampler:
        sampler.start()
        time.sleep(0.01)
    reset = _reset_peak(cuda)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.step()
    if cuda:
        torch.cuda.synchronize()
    elapsed, peak = time.perf_counter() - start, _peak(cuda)
    if sampler:
        sampler.done.set()
        sampler.join()
    states = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.numel() > 1]
    backend = "torch.optim"
    if side == "ours":
        try:
            from lightning_optim import ops

            backend = ops.backend_for(params[0].device.type)
        except Exception:  # noqa: BLE001  (an older checkout)
            backend = "?"
    print("RESULT " + json.dumps({
        "device": params[0].device.type, "params": sum(p.numel() for p in params), "reset_ok": reset,
        "rise_bytes": peak - before, "sampled_rise_bytes": sampler.peak - before if sampler else None,
        "samples": sampler.samples if sampler else 0, "built_bytes": built, "kept_bytes": _now(cuda) - before,
        "state_bytes": _tensor_bytes(states), "step_s": elapsed, "backend": backend,
        "code": str(Path(lightning_optim.__file__).resolve().parent.parent)}), flush=True)


def run_first_step(label: str, model: str, size: str, threads: int, code_root: str | None) -> dict:
    """``first_step_child`` in a fresh process (this file; ``code_root``: with that checkout's library)."""
    cmd = [sys.executable, _SCRIPT, "--first-step-child", label, "--model", model, "--size", size,
           "--threads", str(threads)]
    env = {"MALLOC_MMAP_THRESHOLD_": "65536", **os.environ, "PYTHONWARNINGS": "ignore"}
    if code_root:  # another checkout's library (e.g. a worktree of an older commit), this script
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [code_root, os.environ.get("PYTHONPATH")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=code_root)
    if proc.returncode != 0:
        raise SystemExit(f"first step of {label} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return _result(proc.stdout, label)


def report_first_step(model: str, size: str, threads: int, names: list[str], code_root: str | None) -> dict:
    """Runs ``names`` and their torch.optim counterparts on ``model``, prints the table, returns its figures."""
    wanted = sorted({FIRST_STEP[n][1] or "AdamW" for n in names}, key=list(TORCH_FIRST).index)
    torch_res = {t: run_first_step(f"torch:{t}", model, size, threads, code_root) for t in wanted}
    ours = {n: run_first_step(f"ours:{n}", model, size, threads, code_root) for n in names}
    ref = next(iter(torch_res.values()))
    what = "peak RSS during the step (ru_maxrss, reset right before it)" if ref["device"] == "cpu" else \
        "torch.cuda.max_memory_allocated during the step (reset right before it)"
    shape = (f"ByteGPT {SIZES[size]} after one forward/backward" if model == "gpt"
             else f"{TENSORS} plain Parameters of {TENSOR_NUMEL:,} elements, random grads")
    print(f"# first-step memory ({ref['device']}): {shape} = {ref['params']:,} fp32 params; a fresh process per "
          f"optimizer, {threads} torch thread(s); code: {ref['code']}")
    print(f"rise = {what} - memory held before the optimizer was built; sampled = the same from /proc/self/statm "
          f"every ~1 ms; extra = rise - own state; diff = (extra - torch's extra) / own state; goal <= "
          f"+{GOAL:.0%} (a counterpart with the same states: rise <= torch's rise + {GOAL:.0%} of the state)")
    print(f"{'optimizer':14s} {'backend':>7s} {'state MB':>8s} {'rise MB':>7s} {'sampled':>7s} {'extra MB':>8s} "
          f"{'step s':>6s} | {'torch.optim':12s} {'state MB':>8s} {'rise MB':>7s} {'sampled':>7s} {'extra MB':>8s} | "
          f"{'diff':>7s}  goal")
    rows = {}

    def mb(v):
        return f"{v / MB:7.1f}" if v is not None else f"{'n/a':>7s}"

    for name in names:
        r, counterpart = ours[name], FIRST_STEP[name][1]
        t = torch_res[counterpart or "AdamW"]
        extra, t_extra = r["rise_bytes"] - r["state_bytes"], t["rise_bytes"] - t["state_bytes"]
        diff = (extra - t_extra) / r["state_bytes"] if r["state_bytes"] else float("nan")
        met = bool(diff <= GOAL) and r["reset_ok"] and t["reset_ok"]
        tname = counterpart or "AdamW*"
        note = "" if counterpart is None or r["state_bytes"] == t["state_bytes"] else "  (states differ)"
        print(f"{name:14s} {r['backend']:>7s} {r['state_bytes'] / MB:8.1f} {mb(r['rise_bytes'])} "
              f"{mb(r['sampled_rise_bytes'])} {extra / MB:8.1f} {r['step_s']:6.2f} | {tname:12s} "
              f"{t['state_bytes'] / MB:8.1f} {mb(t['rise_bytes'])} {mb(t['sampled_rise_bytes'])} {t_extra / MB:8.1f} | "
              f"{diff:+7.1%}  {MET[met]}{note}")
        rows[name] = {"ours": r, "torch": tname, "diff_over_state": diff, "met": met}
    print("AdamW* = no torch.optim counterpart: compared with torch.optim.AdamW by what each needs beyond its own "
          "states")
    return {"model": model, "size": SIZES[size] if model == "gpt" else {"tensors": TENSORS, "numel": TENSOR_NUMEL},
            "code": ref["code"], "torch": torch_res, "rows": rows}



def main(argv=None) -> None:
    """The child process of ``run_first_step``: one optimizer's first step, one ``RESULT {...}`` line."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--first-step-child", required=True, metavar="LABEL",
                   help="ours:NAME or torch:NAME (NAME one of our optimizers / torch.optim's counterpart)")
    p.add_argument("--model", default="gpt", choices=("gpt", "tensors"))
    p.add_argument("--size", default="full", choices=tuple(SIZES))
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    first_step_child(args.first_step_child, args.model, args.size, args.threads)


if __name__ == "__main__":
    main()
