"""Training-step time of the OnebitAdam strategy vs Lightning's DDP + AdamW, 2 gloo ranks.

Both ranks run a real ``Trainer`` on the main job's model (``--model small``: ~4.8M params) with
random byte windows; each step's time (batch start to batch end: forward, backward with DDP's
allreduce, optimizer step with its collectives) is taken on each rank and the slower rank's
counts; medians are reported for

* ``DDP + AdamW``: ``DDPStrategy`` (gloo fp32 allreduce of all gradients) + ``torch.optim.AdamW``;
* ``OnebitAdam warmup``: ``OnebitAdamStrategy`` before ``freeze_step`` (the switchable fp32
  allreduce, full-precision Adam);
* ``OnebitAdam compression``: after ``freeze_step`` (DDP's allreduce off, 1-bit momentum
  allreduce): the goal is >= 3x faster than DDP + AdamW;
* ``--overlap`` adds two more runs: ``OnebitAdamStrategy(overlap=True)`` (each unit
  of momenta exchanged from DDP's comm hook while backward runs) and the same with the 1-bit
  collectives replaced by local copies (``no comm``: every pass computed, nothing on the wire); the
  goal is an overlapped compression step within 1.15x of the no-comm one.

    python benchmarks/onebit_step.py --netns      # ranks in two network namespaces on a veth pair
                                                 # shaped to --rate (1gbit) with tc tbf (root +
                                                 # iproute2; prints a note and exits 0 otherwise)
    python benchmarks/onebit_step.py              # loopback (127.0.0.1)
Options: --model small|tiny --batch 4 --seq-len 64 --warmup-steps 6 --steps 12 --threads 1 --overlap --unit-mb MB
(--steps timed steps per stage after --skip 2). The --netns mode uses only 10.123.0.1/2 inside
the namespaces it creates (benchmarks/comm.py: netns_pair) and deletes them on exit.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from comm import NETNS_ADDRS, NetnsUnavailable, _free_port, machine_facts, netns_pair  # noqa: E402
from results import save  # noqa: E402

MODELS = {
    "tiny": dict(n_layer=4, n_head=4, d_model=128, mlp_ratio=4),
    "small": dict(n_layer=6, n_head=8, d_model=256, mlp_ratio=4),
}


# ----------------------------------------------------------------------------- rank side
def _fit(args, mode: str) -> list[list[float]]:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_optim.lightning import OnebitAdamStrategy
    from lightning_optim.model import LanguageModel

    class StepTimer(pl.Callback):
        """Per step: the whole step, and its optimizer part (clipping + step with its collectives)."""

        def __init__(self) -> None:
            self.times: list[list[float]] = []
            self._start = self._opt = 0.0

        def on_train_batch_start(self, *a) -> None:
            self._start = time.perf_counter()

        def on_before_optimizer_step(self, *a) -> None:
            self._opt = time.perf_counter()

        def on_train_batch_end(self, *a) -> None:
            now = time.perf_counter()
            self.times.append([now - self._start, now - self._opt])

    pl.seed_everything(0)
    if mode == "nocomm":
        _remove_onebit_communication()
    steps = args.warmup_steps + args.steps + args.skip if mode != "ddp" else args.steps + args.skip
    data = torch.randint(0, 256, (steps * args.batch * 2, args.seq_len + 1), generator=torch.Generator().manual_seed(1))
    model = LanguageModel(MODELS[args.model], args.seq_len, scheduler=None,
                          optimizer=functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.1))
    strategy = (DDPStrategy(find_unused_parameters=False) if mode == "ddp"
                else OnebitAdamStrategy(freeze_step=args.warmup_steps, telemetry=False,
                                        overlap=mode in ("overlap", "nocomm"),
                                        overlap_unit_mb=args.unit_mb if mode in ("overlap", "nocomm") else None))
    timer = StepTimer()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
                         callbacks=[timer], limit_val_batches=0, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=args.batch))
    return timer.times


def _remove_onebit_communication() -> None:
    """The 1-bit allreduce's collectives become local copies of the right shapes (every pass still
    runs on real data; nothing goes on the wire), and the per-call and per-step agreements are skipped.
    DDP's warmup allreduce is untouched (warmup steps are not compared)."""
    import torch.distributed as dist

    import lightning_optim.comm.compressed as compressed
    from lightning_optim.onebit.base import OnebitOptimizer

    def local(name, fn, *args, group=None, **kwargs):
        out, inp = args
        if fn is dist.all_to_all_single:
            out.copy_(inp)
        else:  # all_gather of one row per rank
            out.view(-1, inp.numel()).copy_(inp.view(1, -1).expand(out.numel() // inp.numel(), -1))

    compressed.collective = local
    compressed._agree = lambda *a, **k: None
    OnebitOptimizer._agree = lambda *a, **k: None


def worker(args) -> None:
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    os.environ.update(LOCAL_RANK=str(args.rank), NODE_RANK="0", WORLD_SIZE="2", MASTER_ADDR=args.addr,
                      MASTER_PORT=str(args.port), OMP_NUM_THREADS=str(args.threads))
    torch.set_num_threads(args.threads)
    out = {}
    for repeat in range(args.repeats):  # interleaved, so load changes hit both
        for mode in ("ddp", "onebit") + (("overlap", "nocomm") if args.overlap else ()):
            out.setdefault(mode, []).append(_fit(args, mode))
    gathered = [None, None]
    dist.all_gather_object(gathered, out)
    if args.rank == 0:
        print("RESULT " + json.dumps(gathered), flush=True)
    dist.destroy_process_group()  # shut gloo's threads down before interpreter exit


# ----------------------------------------------------------------------------- parent side
def _launch(args, addr: str, port: int, prefixes=(None, None), envs=(None, None)) -> list:
    procs = []
    for rank in range(2):
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--rank", str(rank), "--addr", addr,
               "--port", str(port)] + [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                                       if v is not None and k in ("model", "batch", "seq_len", "warmup_steps", "steps",
                                                                  "skip", "threads", "repeats", "overlap", "unit_mb")]
        if prefixes[rank]:
            cmd = list(prefixes[rank]) + cmd
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=dict(os.environ, **(envs[rank] or {}))))
    outputs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"benchmark ranks failed: exit codes {[p.returncode for p in procs]}")
    for line in outputs[0].splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise SystemExit("rank 0 printed no result")


def report(args, ranks: list, mode: str) -> None:
    def slowest(name: str, lo: int, hi: int, part: int) -> list[float]:
        per_repeat = [[max(a[part], b[part]) for a, b in zip(r0[lo:hi], r1[lo:hi])]
                      for r0, r1 in zip(ranks[0][name], ranks[1][name])]
        return [t for rep in per_repeat for t in rep]

    w, n, skip = args.warmup_steps, args.steps, args.skip
    spans = {"ddp": ("ddp", skip, skip + n), "warmup": ("onebit", skip, w),  # warmup steps after `skip`
             "compression": ("onebit", w + skip, w + skip + n)}
    ddp, warm, comp = (slowest(*spans[k], 0) for k in ("ddp", "warmup", "compression"))
    med = {k: statistics.median(slowest(*span, 0)) for k, span in spans.items()}
    opt = {k: statistics.median(slowest(*span, 1)) for k, span in spans.items()}
    facts = machine_facts()
    params = _param_count(args.model, args.seq_len)
    print(f"# 1-bit Adam training step ({mode}); model={args.model} ({params / 1e6:.1f}M params), batch {args.batch}"
          f" x {args.seq_len} tokens per rank, 2 ranks, {args.threads} torch thread(s) per rank; medians of the"
          f" slower rank over {len(ddp)} / {len(warm)} / {len(comp)} steps")
    print(f"machine: {facts['cpu']}, {facts['cores']} cores, torch {facts['torch']}, python {facts['python']};"
          f" load average at the end: {facts['loadavg_1_5_15min']}")
    print("                          whole step   of which optimizer step (clipping + step + its collectives)")
    print(f"DDP + AdamW             : {med['ddp'] * 1e3:8.1f} ms   {opt['ddp'] * 1e3:8.1f} ms")
    print(f"OnebitAdam warmup       : {med['warmup'] * 1e3:8.1f} ms   {opt['warmup'] * 1e3:8.1f} ms"
          f"   ({med['ddp'] / med['warmup']:.2f}x DDP's step time)")
    print(f"OnebitAdam compression  : {med['compression'] * 1e3:8.1f} ms   {opt['compression'] * 1e3:8.1f} ms")
    print(f"ratio DDP / compression : {med['ddp'] / med['compression']:6.2f}x   (goal >= 3x)")
    if args.overlap:
        for name in ("overlap", "nocomm"):
            med[name] = statistics.median(slowest(name, w + skip, w + skip + n, 0))
            opt[name] = statistics.median(slowest(name, w + skip, w + skip + n, 1))
        print(f"compression, overlapped : {med['overlap'] * 1e3:8.1f} ms   {opt['overlap'] * 1e3:8.1f} ms")
        print(f"compression, no comm    : {med['nocomm'] * 1e3:8.1f} ms   {opt['nocomm'] * 1e3:8.1f} ms"
              "   (the 1-bit collectives replaced by local copies)")
        print(f"overlapped / no comm    : {med['overlap'] / med['nocomm']:6.2f}x   (goal <= 1.15x); "
              f"not overlapped / no comm: {med['compression'] / med['nocomm']:.2f}x")
    name = f"onebit_step_{'netns' if args.netns else 'loopback'}_{args.batch}x{args.seq_len}"
    save(name + ("_overlap" if args.overlap else ""),
         {"mode": mode, "model": args.model, "params": params, "batch": args.batch, "seq_len": args.seq_len,
          "rate": args.rate if args.netns else None, "steps_per_stage": len(ddp), "repeats": args.repeats,
          "ms": {k: v * 1e3 for k, v in med.items()}, "optimizer_ms": {k: v * 1e3 for k, v in opt.items()},
          "ratio": med["ddp"] / med["compression"], "machine": facts})


def _param_count(model: str, seq_len: int) -> int:
    from lightning_optim.model import ByteGPT

    return sum(p.numel() for p in ByteGPT(max_seq_len=seq_len, **MODELS[model]).parameters())


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="small")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--warmup-steps", type=int, default=6)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--skip", type=int, default=2, help="first steps of each stage left out (DDP bucket rebuild)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--netns", action="store_true")
    p.add_argument("--overlap", type=lambda v: v in ("1", "True", "true"), nargs="?", const=True, default=False)
    p.add_argument("--unit-mb", type=float, default=None, help="compression unit size with --overlap (MB of fp32; default: DDP's bucket_cap_mb)")
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--addr", default="127.0.0.1", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return
    if args.warmup_steps <= args.skip:
        p.error("--warmup-steps must exceed --skip (some warmup steps are timed)")
    if not args.netns:
        ranks = _launch(args, "127.0.0.1", _free_port(), envs=({"GLOO_SOCKET_IFNAME": "lo"},) * 2)
        report(args, ranks, "loopback 127.0.0.1")
        return
    try:
        with netns_pair(args.rate) as (prefixes, envs):
            ranks = _launch(args, NETNS_ADDRS[0], 29519, prefixes, envs)
            report(args, ranks, f"2 network namespaces, veth shaped to {args.rate} (tc tbf)")
    except NetnsUnavailable as exc:
        print(f"--netns {exc}: skipped")


if __name__ == "__main__":
    main()
