"""HSDP + 1-bit Adam: 4 gloo ranks as 2 nodes x 2, HSDP mesh (replicate = node, shard = the
ranks of a node), the main job's ``small`` ByteGPT sharded with ``fully_shard`` per block + root.

The ranks run in network namespaces (``netns_bridge.netns_nodes``): the ranks of a node share an unshaped bridge,
the nodes are joined by uplinks shaped with ``tc tbf`` to ``--rate``. In the same processes, interleaved, one
training step of each variant (own model, own optimizer, same batches; random bytes, ``--batch`` x ``--seq``):

* ``HSDP + AdamW``: ``torch.optim.AdamW`` on the sharded params (HSDP's fp32 all-reduce across the nodes);
* ``HSDP + OnebitAdam, warmup``: ``onebit_fsdp`` with ``freeze_step`` never reached (HSDP's all-reduce too);
* ``HSDP + OnebitAdam, 1-bit``: ``onebit_fsdp``, ``freeze_step=--freeze-step``; timed steps are past it;
* ``barriers only``: the measurement's own traffic (the barriers around each step).

Per step: the slowest rank's time (median of ``--iters`` after ``--warmup`` untimed steps, >= freeze_step + 1),
the bytes on the wire (``Uplinks.tx_bytes`` deltas: over both uplinks = inter-node; delivered to the 4 rank
veths = all traffic; their difference = intra-node: FSDP's all-gathers / reduce-scatters in the shard group),
``comm_stats()`` deltas summed over the ranks (torch's HSDP all-reduce is not ours: not counted), and the
expected inter-node bytes (fp32: a 2-rank ring all-reduce of each rank's shard; 1-bit: ``compressed_bytes``).
Then, optimizer state held per rank (storages of the state tensors, flat buffers once, plus the 1-bit error
buffers; ``Layout.scratch`` work buffers apart): AdamW and OnebitAdam under HSDP (2 x 2), and OnebitAdam over
the whole, unsharded model on a 4-rank group (what every DDP rank holds).

    python benchmarks/hsdp.py                          # small model, batch 4 x 128, at 1gbit and 100mbit
    python benchmarks/hsdp.py --quick                  # 1gbit, 2 timed steps
Options: --iters 5 --warmup 4 --freeze-step 2 --batch 4 --seq 128 --rate 1gbit,100mbit --json PATH.
Needs root and iproute2; elsewhere prints ``NetnsUnavailable: ...`` and exits 0.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import date, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(ROOT))
from netns_bridge import NetnsUnavailable, Uplinks, netns_nodes, run_node_ranks  # noqa: E402

NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
PORT = 29571
VARIANTS = ("adamw", "onebit_warmup", "onebit", "idle")
LABELS = {"adamw": "HSDP + AdamW", "onebit_warmup": "HSDP + OnebitAdam, warmup",
          "onebit": "HSDP + OnebitAdam, 1-bit", "idle": "barriers only"}
HYPER = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)  # conf/optimizer/adamw.yaml


# ----------------------------------------------------------------------------- rank side
def held_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: their local shard; views counted once)."""
    from torch.distributed.tensor import DTensor

    storages = {}
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def optimizer_memory(opt) -> dict[str, int]:
    import torch

    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    comp = getattr(opt, "compressor", None)
    errors = [e for e in (getattr(comp, "worker_error", None), getattr(comp, "server_error", None)) if e is not None]
    layout = getattr(opt, "_layout", None)
    scratch = [t for entry in (layout.scratch.values() if layout else ()) for t in entry if torch.is_tensor(t)]
    return {"state": held_bytes(state), "errors": held_bytes(errors), "scratch": held_bytes(scratch),
            "params": sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                          for g in opt.param_groups for p in g["params"])}


def worker(args: argparse.Namespace, hub: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from omegaconf import OmegaConf
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_optim import OnebitAdam
    from lightning_optim.comm import comm_stats
    from lightning_optim.comm.compressed import compressed_bytes
    from lightning_optim.comm.stats import ring_allreduce_bytes
    from lightning_optim.model import ByteGPT
    from lightning_optim.onebit import onebit_fsdp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=1800))  # env://: MASTER_ADDR = rank 0's namespace
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (NODES, PER_NODE), mesh_dim_names=("replicate", "shard"))  # node k: 2k, 2k+1
    sizes = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / "small.yaml"))

    def build(name: str, sharded: bool = True):
        torch.manual_seed(0)
        model = ByteGPT(max_seq_len=args.seq, **sizes)
        if not sharded:
            return model, OnebitAdam(model.parameters(), freeze_step=1, **HYPER)  # every rank: the whole model
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if name == "adamw":
            return model, torch.optim.AdamW(model.parameters(), **HYPER)
        opt = OnebitAdam(model.parameters(), freeze_step=args.freeze_step if name == "onebit" else 10**9, **HYPER)
        onebit_fsdp(model, opt)
        return model, opt

    def train_step(model, opt, it: int) -> None:
        gen = torch.Generator().manual_seed(1000 * it + rank)
        tokens = torch.randint(0, 256, (args.batch, args.seq + 1), generator=gen)
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    runs = {name: build(name) for name in VARIANTS if name != "idle"}
    # wire counters, read by rank 0: what left the nodes, and what all rank veths received (= all traffic)
    inter = Uplinks(hub, ("up0", "up1")) if rank == 0 else None
    every = Uplinks(hub, tuple(f"p{r}" for r in range(WORLD))) if rank == 0 else None
    keys = ("s", "inter", "all", "sent", "fp32_equiv", "compressed_calls", "control_calls")
    rows = {v: {k: [] for k in keys} for v in VARIANTS}
    for it in range(args.warmup + args.iters):
        for name in VARIANTS:
            dist.barrier()
            wire0 = (inter.tx_bytes(), every.tx_bytes()) if rank == 0 else (0, 0)
            dist.barrier()
            before = comm_stats().copy()
            start = time.perf_counter()
            if name != "idle":
                train_step(*runs[name], it)
            elapsed = time.perf_counter() - start
            d = comm_stats() - before
            dist.barrier()
            wire = (inter.tx_bytes() - wire0[0], every.tx_bytes() - wire0[1]) if rank == 0 else (0, 0)
            slowest = torch.tensor([elapsed], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            counted = torch.tensor([d.bytes_sent, d.fp32_equivalent_bytes, d.compressed_calls, d.control_calls])
            dist.all_reduce(counted)
            if it >= args.warmup:
                for k, v in zip(keys, (slowest.item(), *wire, *counted.tolist())):
                    rows[name][k].append(v)
    assert runs["onebit"][1].in_compression_stage and not runs["onebit_warmup"][1].in_compression_stage
    local = sum(p.to_local().numel() for p in runs["adamw"][0].parameters())
    expected = torch.tensor([ring_allreduce_bytes(local, NODES), compressed_bytes(local, NODES)])
    dist.all_reduce(expected)  # summed over the ranks, like the wire counters (segments ignored: ~4 B per param)
    memory = {"hsdp_adamw": optimizer_memory(runs["adamw"][1]), "hsdp_onebit": optimizer_memory(runs["onebit"][1])}
    if args.state:
        del runs
        model, opt = build("ddp", sharded=False)
        for it in range(2):  # warmup step, then one compressed step (error buffers made)
            train_step(model, opt, it)
        memory["ddp_onebit"] = optimizer_memory(opt)
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, memory)
    if rank == 0:
        out = {v: {k: statistics.median(x) for k, x in rows[v].items()} for v in VARIANTS}
        out["expected_inter"] = dict(zip(("fp32", "onebit"), expected.tolist()))
        out["memory_per_rank"] = gathered
        print("RESULT " + json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- parent side
def measure(rate: str, args: argparse.Namespace, state: bool) -> dict:
    passed = ("iters", "warmup", "freeze_step", "batch", "seq")
    options = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in passed]
    options += ["--state"] if state else []
    with netns_nodes(NODES, PER_NODE, rate) as (prefixes, envs, uplinks):
        return run_node_ranks(prefixes, envs, PER_NODE, [os.path.abspath(__file__), "--worker", uplinks.hub, *options],
                              PORT, args.timeout)


def report(rate: str, res: dict, args: argparse.Namespace, load: str) -> dict:
    mb = 1e6
    print(f"\n### {rate} between the nodes: small ByteGPT, batch {args.batch} x {args.seq} per rank, median of "
          f"{args.iters} steps after {args.warmup} (load average after: {load})\n")
    print("| variant | step ms (slowest rank) | inter-node wire MB | intra-node wire MB | expected inter MB | "
          "CommStats sent MB (fp32 equiv.) | compressed / control calls |\n|---|---:|---:|---:|---:|---:|---:|")
    expected = {"adamw": "fp32", "onebit_warmup": "fp32", "onebit": "onebit"}
    for v in VARIANTS:
        r = res[v]
        exp = f"{res['expected_inter'][expected[v]] / mb:.2f}" if v in expected else "-"
        print(f"| {LABELS[v]} | {r['s'] * 1e3:.0f} | {r['inter'] / mb:.2f} | {(r['all'] - r['inter']) / mb:.2f} | "
              f"{exp} | {r['sent'] / mb:.2f} ({r['fp32_equiv'] / mb:.2f}) | "
              f"{r['compressed_calls']:.0f} / {r['control_calls']:.0f} |")
    idle = res["idle"]["inter"]
    ratios = {"inter_wire_adamw_over_onebit": res["adamw"]["inter"] / res["onebit"]["inter"],
              "inter_wire_adamw_over_onebit_less_barriers": (res["adamw"]["inter"] - idle)
              / (res["onebit"]["inter"] - idle),
              "step_time_adamw_over_onebit": res["adamw"]["s"] / res["onebit"]["s"]}
    print(f"\ninter-node bytes per step, HSDP + AdamW / HSDP + OnebitAdam (1-bit): "
          f"{ratios['inter_wire_adamw_over_onebit']:.1f}x on the wire, "
          f"{ratios['inter_wire_adamw_over_onebit_less_barriers']:.1f}x without the barriers' bytes (goal >= 30x); "
          f"step time AdamW / 1-bit: {ratios['step_time_adamw_over_onebit']:.2f}x")
    return ratios


def report_memory(per_rank: list[dict]) -> dict:
    labels = {"hsdp_adamw": "torch AdamW, HSDP 2 x 2", "hsdp_onebit": "OnebitAdam, HSDP 2 x 2 (`onebit_fsdp`)",
              "ddp_onebit": "OnebitAdam, whole model on 4 ranks (DDP)"}
    print("\n### Optimizer state held per rank (the largest rank; MB = 1e6 bytes)\n")
    print("| optimizer | param elements | moments MB | error buffers MB | state MB | work buffers MB |"
          "\n|---|---:|---:|---:|---:|---:|")
    largest = {}
    for key, label in labels.items():
        if key not in per_rank[0]:
            continue
        m = max((r[key] for r in per_rank), key=lambda x: x["state"] + x["errors"])
        largest[key] = m
        print(f"| {label} | {m['params']:,} | {m['state'] / 1e6:.2f} | {m['errors'] / 1e6:.2f} | "
              f"{(m['state'] + m['errors']) / 1e6:.2f} | {m['scratch'] / 1e6:.2f} |")
    if "ddp_onebit" in largest:
        h, d = largest["hsdp_onebit"], largest["ddp_onebit"]
        ratio = (h["state"] + h["errors"]) / (d["state"] + d["errors"])
        print(f"\nOnebitAdam state per rank, HSDP / DDP: {ratio:.3f} (goal ~ 1/shard = {1 / PER_NODE:.3f})")
        largest["hsdp_over_ddp"] = ratio
    return largest


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=4, help="untimed steps first (>= freeze-step + 1)")
    p.add_argument("--freeze-step", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--rate", default="1gbit,100mbit", help="tc rate(s) of the uplinks, comma-separated")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--quick", action="store_true", help="1gbit only, 2 timed steps")
    p.add_argument("--json", default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # the hub namespace (rank side)
    p.add_argument("--state", action="store_true", help=argparse.SUPPRESS)  # this run also measures DDP's state
    args = p.parse_args(argv)
    if args.quick:
        args.iters, args.rate = 2, "1gbit"
    if args.warmup < args.freeze_step + 1:
        p.error(f"--warmup {args.warmup} must be >= --freeze-step + 1 = {args.freeze_step + 1} (time 1-bit steps)")
    if args.worker:
        return worker(args, args.worker)
    from comm import machine_facts

    facts = machine_facts()
    print(f"# HSDP + 1-bit benchmark, {date.today()}: {facts['cpu']}, nproc {facts['cores']}, torch {facts['torch']}, "
          f"python {facts['python']}, load average {facts['loadavg_1_5_15min']}")
    out = {"machine": facts, "args": {k: v for k, v in vars(args).items() if k not in ("worker", "state")},
           "rates": {}}
    try:
        for i, rate in enumerate(args.rate.split(",")):
            res = measure(rate, args, state=i == 0)
            load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
            out["rates"][rate] = {"result": res, "loadavg_after": load, "ratios": report(rate, res, args, load)}
            if i == 0:
                out["memory"] = report_memory(res["memory_per_rank"])
    except NetnsUnavailable as exc:
        print(f"NetnsUnavailable: {exc}; the benchmark needs network namespaces (root + iproute2): skipped")
        return
    from results import save

    save("hsdp", out, keep=not args.quick)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
