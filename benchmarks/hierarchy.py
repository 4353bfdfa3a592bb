"""Hierarchical 1-bit across nodes: 4 gloo ranks as 2 nodes x 2, shaped inter-node link.

The ranks run in network namespaces (``netns_bridge.netns_nodes``): the two ranks of a node share an unshaped
bridge, each node reaches the other over one uplink veth shaped with ``tc tbf`` to ``--rate`` (both ranks of
a node share it). In the same processes, interleaved, on one flat fp32 buffer (reset before every call):

* ``flat 1-bit``: ``OnebitCompressor().reduce_flat_`` over all 4 ranks;
* ``hier 1-bit``: ``HierarchicalOnebitCompressor(2).reduce_flat_`` (fp32 reduce-scatter in the node, 1-bit
  across nodes on the half shard, fp32 all-gather in the node);
* ``hier 1-bit (ar)``: ``hier 1-bit`` with the node's reduce-scatter and all-gather each replaced by one
  ``all_reduce`` in the node (the all-gather as the sum of zero-padded shards: the same bits). Not in the
  library: gloo's ``reduce_scatter_single`` / ``all_gather_single`` are several times slower here than an
  ``all_reduce``, which does the work of both;
* ``hier fp32``: ``HierarchicalOnebitCompressor(2).average_flat_`` (the same with fp32 across nodes);
* ``flat fp32``: ``torch.distributed.all_reduce`` over all 4 ranks (+ division);
* ``node fp32``: ``all_reduce`` inside each node only (both nodes at once), and ``node rsag``: the library's
  reduce-scatter + all-gather inside each node: the intra-node links the model is given (not variants).

Per exchange: the slowest rank's time (median of ``--iters`` after ``--warmup``), the time spent in the node
collectives and in the other collectives (slowest rank, waits included), the bytes that crossed the uplinks
(wire counters ``tx_bytes`` of both uplinks: Ethernet frames, TCP/IP headers and ACKs included, barriers
around the call too) and ``CommStats`` summed over the ranks (``inter_node_bytes``; the flat 1-bit exchange
knows no nodes, so its figure is all it sent, same node included; ``dist.all_reduce`` is not counted). The
model column is ``scale_formulas`` (``allreduce`` / ``onebit_allreduce`` with a hierarchical ``Topology``):
inter link = the tc rate shared by the ranks crossing it; intra link = fitted on ``node rsag`` (the library's
reduce-scatter + all-gather, priced by the formulas as one ring all-reduce's bytes), for the ``(ar)``
variant on ``node fp32`` (two all_reduces); 1-bit compute measured here at each
call's own size and world (one rank alone, collectives skipped) x ``memory_share_slowdown(4)`` (4 ranks
computing at once on this VM).

    python benchmarks/hierarchy.py                       # 25M fp32 (100 MB), at 1gbit and 100mbit
    python benchmarks/hierarchy.py --quick               # 2M fp32, 2 timed iterations
Options: --numel 25000000 --iters 5 --warmup 1 --rate 1gbit,100mbit --alpha-us 215 --json PATH.
Needs root and iproute2; elsewhere prints ``NetnsUnavailable: ...`` and exits 0. Uses only 10.124.0.0/24
inside the namespaces it creates, and deletes them on exit.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from netns_bridge import NetnsUnavailable, Uplinks, netns_nodes, run_node_ranks  # noqa: E402

NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
PORT = 29563
VARIANTS = ("flat_1bit", "hier_1bit", "hier_1bit_ar", "hier_fp32", "flat_fp32", "node_fp32", "node_rsag")
LABELS = {"flat_1bit": "flat 1-bit", "hier_1bit": "hier 1-bit", "hier_1bit_ar": "hier 1-bit (ar)",
          "hier_fp32": "hier fp32",
          "flat_fp32": "flat fp32 all_reduce", "node_fp32": "node fp32 all_reduce (intra fit, ar)",
          "node_rsag": "node fp32 reduce-scatter + all-gather (intra fit)"}


# ----------------------------------------------------------------------------- rank side
def worker(numel: int, iters: int, warmup: int, hub: str, devices: list[str]) -> None:
    import torch
    import torch.distributed as dist

    import lightning_optim.comm.compressed as compressed_mod
    import lightning_optim.comm.dense as dense_mod
    import lightning_optim.comm.hierarchy as hierarchy_mod
    import lightning_optim.comm.timeouts as timeouts_mod
    from lightning_optim.comm import comm_stats
    from lightning_optim.comm.compressors import OnebitCompressor
    from lightning_optim.comm.compressors.hierarchical import HierarchicalOnebitCompressor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=1800))  # env://: MASTER_ADDR = rank 0's namespace
    rank = dist.get_rank()
    spent = {"node": 0.0, "cross": 0.0}

    def timed(inner, key):
        def wrapper(name, fn, *args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(name, fn, *args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - start
        return wrapper

    hierarchy_mod.collective = timed(hierarchy_mod.collective, "node")  # reduce-scatter / all-gather in the node
    for mod in (compressed_mod, dense_mod, timeouts_mod):
        mod.collective = timed(mod.collective, "cross")

    src = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    buf = torch.empty_like(src)
    flat, hier = OnebitCompressor(), HierarchicalOnebitCompressor(PER_NODE)
    groups = hier.node_groups()
    uplinks = Uplinks(hub, tuple(devices)) if rank == 0 else None

    def flat_fp32(x):
        dist.all_reduce(x)
        x.div_(WORLD)

    def node_fp32(x):
        dist.all_reduce(x, group=groups.intra)
        x.div_(PER_NODE)

    half = torch.empty(-(-numel // PER_NODE))
    padded = torch.zeros(half.numel() * PER_NODE)

    def node_rsag(x):  # the library's node collectives (hierarchy._reduce_scatter_single / _all_gather_single)
        padded[:numel].copy_(x)
        hierarchy_mod._reduce_scatter_single(half, padded, group=groups.intra)
        hierarchy_mod._all_gather_single(padded, half, group=groups.intra)

    # synchronous stand-ins for collective(); padded is hierarchy's scratch (overwritten by the all-gather anyway)
    def reduce_scatter_ar(out, padded, group=None, async_op=False):
        dist.all_reduce(padded, group=group)
        size = out.numel()
        out.copy_(padded[groups.local_rank * size:(groups.local_rank + 1) * size])

    def all_gather_ar(padded, shard, group=None, async_op=False):
        size = shard.numel()
        padded.zero_()
        padded[groups.local_rank * size:(groups.local_rank + 1) * size].copy_(shard)
        dist.all_reduce(padded, group=group)

    def hier_1bit_ar(x):
        saved = hierarchy_mod._reduce_scatter_single, hierarchy_mod._all_gather_single
        hierarchy_mod._reduce_scatter_single, hierarchy_mod._all_gather_single = reduce_scatter_ar, all_gather_ar
        try:
            hier_ar.reduce_flat_(x)
        finally:
            hierarchy_mod._reduce_scatter_single, hierarchy_mod._all_gather_single = saved

    hier_ar = HierarchicalOnebitCompressor(PER_NODE)
    calls = {"flat_1bit": flat.reduce_flat_, "hier_1bit": hier.reduce_flat_, "hier_1bit_ar": hier_1bit_ar,
             "hier_fp32": hier.average_flat_, "flat_fp32": flat_fp32, "node_fp32": node_fp32, "node_rsag": node_rsag}
    rows: dict[str, dict[str, list[float]]] = {v: {"s": [], "node_s": [], "cross_s": [], "wire": []} for v in VARIANTS}
    telemetry: dict[str, list[int]] = {}
    for it in range(warmup + iters):
        for name in VARIANTS:
            buf.copy_(src)
            dist.barrier()
            wire0 = uplinks.tx_bytes() if uplinks else 0
            dist.barrier()
            before = comm_stats().copy()
            spent.update(node=0.0, cross=0.0)
            start = time.perf_counter()
            calls[name](buf)
            elapsed = time.perf_counter() - start
            delta = comm_stats() - before
            dist.barrier()
            wire = uplinks.tx_bytes() - wire0 if uplinks else 0
            slowest = torch.tensor([elapsed, spent["node"], spent["cross"]], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            counted = torch.tensor([delta.bytes_sent, delta.intra_node_bytes, delta.inter_node_bytes])
            dist.all_reduce(counted)
            if it >= warmup:
                for key, value in zip(("s", "node_s", "cross_s", "wire"), (*slowest.tolist(), wire)):
                    rows[name][key].append(value)
                telemetry[name] = counted.tolist()
    if rank == 0:
        out = {v: {**{k: statistics.median(x) for k, x in rows[v].items()},
                   "telemetry": dict(zip(("bytes_sent", "intra_node_bytes", "inter_node_bytes"), telemetry[v]))}
               for v in VARIANTS}
        print("RESULT " + json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- parent side
def rate_bits(rate: str) -> float:
    """tc's rate units (SI): ``1gbit`` -> 1e9 bit/s."""
    for suffix, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
        if rate.lower().endswith(suffix):
            return float(rate[: -len(suffix)]) * scale
    raise ValueError(f"rate {rate!r}: give it as tc does, e.g. 1gbit or 100mbit")


def measure(rate: str, args) -> dict:
    with netns_nodes(NODES, PER_NODE, rate, args.burst) as (prefixes, envs, uplinks):
        argv = [os.path.abspath(__file__), "--worker", str(args.numel), str(args.iters), str(args.warmup), uplinks.hub,
                ",".join(uplinks.devices)]
        return run_node_ranks(prefixes, envs, PER_NODE, argv, PORT, args.timeout)


def model(res: dict, rate: str, args, onebit_s_per_elem: dict[str, float]) -> dict[str, float]:
    """Seconds per exchange from ``scale_formulas`` on this topology (see the module doc)."""
    import scale_formulas as sf
    import scale_validation as sv

    n, alpha, link_bytes = args.numel, args.alpha_us * 1e-6, rate_bits(rate) / 8
    # the node link, fitted on the node collectives each variant uses: reduce-scatter + all-gather (the library,
    # priced by the formulas as one ring all-reduce's bytes), or two all_reduces (the "(ar)" variant)
    intra = sf.Link(0.0, sf.ring_allreduce_bytes(n, PER_NODE) / res["node_rsag"]["s"])
    intra_ar = sf.Link(0.0, sf.ring_allreduce_bytes(n, PER_NODE) / res["node_fp32"]["s"] / 2)
    # each uplink carries: hierarchical, both ranks of the node (one peer each); flat 1-bit, every rank of the
    # node sends (W-L)/(W-1) of its bytes across; flat ring (0->1->2->3->0), one rank's ring traffic
    hier = sf.Topology(WORLD, sf.Link(alpha, link_bytes / PER_NODE), intra, PER_NODE)
    hier_ar = sf.Topology(WORLD, hier.inter, intra_ar, PER_NODE)
    flat_1bit = sf.Topology(WORLD, sf.Link(alpha, link_bytes * (WORLD - 1) / (PER_NODE * (WORLD - PER_NODE))))
    flat_ring = sf.Topology(WORLD, sf.Link(alpha, link_bytes))
    here = sf.MEASURED_HERE
    flat_rates, hier_rates = (sf.ComputeRates(here.adam_s_per_param, onebit_s_per_elem[k], here.stream_bytes_per_s)
                              for k in ("flat", "hier"))
    slow = sv.memory_share_slowdown(WORLD)
    return {"flat_1bit": sf.onebit_allreduce([n], flat_1bit).seconds
            + sf._onebit_compute(n, flat_1bit, flat_rates) * slow,
            "hier_1bit": sf.onebit_allreduce([n], hier).seconds + sf._onebit_compute(n, hier, hier_rates) * slow,
            "hier_1bit_ar": sf.onebit_allreduce([n], hier_ar).seconds
            + sf._onebit_compute(n, hier_ar, hier_rates) * slow,
            "hier_fp32": sf.allreduce(n, hier).seconds,
            "flat_fp32": sf.allreduce(n, flat_ring).seconds}


def where_it_pays(res: dict, args, onebit_s_per_elem: dict[str, float]) -> list[dict]:
    """The validated formulas of :func:`model` beyond this VM: flat 1-bit / hierarchical 1-bit exchange time
    for node links from the one fitted here to NVLink-class, at 2 x 2 ranks (this run) and 8 nodes x 8."""
    import scale_formulas as sf

    n = args.numel
    fitted = sf.ring_allreduce_bytes(n, PER_NODE) / res["node_rsag"]["s"]
    rows = []
    for intra_name, intra_bytes, speedup in (("fitted here", fitted, 1.0), ("10 GB/s (PCIe-class)", 10e9, 50.0),
                                             ("100 GB/s (NVLink-class)", 100e9, 50.0)):
        rates = sf.MEASURED_HERE.scaled(speedup)  # a GPU's HBM: the scale model's --compute-speedup 50
        for inter_gbit in (1, 10):
            for nodes, per_node in ((NODES, PER_NODE), (8, 8)):
                world, inter = nodes * per_node, sf.gbit(inter_gbit, args.alpha_us * 1e-6)
                hier = sf.Topology(world, sf.Link(inter.alpha_s, inter.bytes_per_s / per_node),
                                   sf.Link(0.0, intra_bytes), per_node)
                flat = sf.Topology(world, sf.Link(inter.alpha_s, inter.bytes_per_s * (world - 1)
                                                  / (per_node * (world - per_node))))
                if speedup == 1.0:
                    rates = sf.ComputeRates(rates.adam_s_per_param, onebit_s_per_elem["flat"], rates.stream_bytes_per_s)
                t_flat = sf.onebit_allreduce([n], flat).seconds + sf._onebit_compute(n, flat, rates)
                t_hier = sf.onebit_allreduce([n], hier).seconds + sf._onebit_compute(n, hier, rates)
                rows.append({"intra": intra_name, "inter_gbit": inter_gbit, "ranks": f"{nodes} x {per_node}",
                             "flat_ms": t_flat * 1e3, "hier_ms": t_hier * 1e3, "ratio": t_flat / t_hier})
    print(f"\n### Where hierarchical 1-bit pays (the formulas above, {n:,} fp32; uplink shared by the node's ranks)\n")
    print("| node link | inter-node link | ranks | flat 1-bit ms | hier 1-bit ms | flat / hier |\n|---|---:|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['intra']} | {r['inter_gbit']} Gbit/s | {r['ranks']} | {r['flat_ms']:.1f} | {r['hier_ms']:.1f} | "
              f"{r['ratio']:.2f}x |")
    return rows


def report(rate: str, res: dict, predicted: dict[str, float], args) -> dict:
    h1 = res["hier_1bit"]
    print(f"\n### {rate} between the nodes: {args.numel:,} fp32 ({args.numel * 4 / 1e6:.0f} MB), 2 nodes x 2 ranks, "
          f"median of {args.iters} after {args.warmup} warm-up\n")
    print("| exchange | ms | / hier 1-bit | node colls ms | other colls ms | model ms (error) | "
          "inter-node wire MB | CommStats inter MB (sum of ranks) |\n|---|---:|---:|---:|---:|---:|---:|---:|")
    for v in VARIANTS:
        r = res[v]
        m = predicted.get(v)
        cell = f"{m * 1e3:.1f} ({(m - r['s']) / r['s'] * 100:+.0f}%)" if m is not None else "(fit)"
        tel = r["telemetry"]["inter_node_bytes"]
        tel_cell = "-" if v in ("flat_fp32", "node_fp32", "node_rsag") else f"{tel / 1e6:.2f}"
        tel_cell += " (all sent)" if v == "flat_1bit" else ""
        print(f"| {LABELS[v]} | {r['s'] * 1e3:.1f} | {r['s'] / h1['s']:.2f}x | {r['node_s'] * 1e3:.1f} | "
              f"{r['cross_s'] * 1e3:.1f} | {cell} | {r['wire'] / 1e6:.2f} | {tel_cell} |")
    ratios = {"time_flat_1bit_over_hier_1bit": res["flat_1bit"]["s"] / h1["s"],
              "time_flat_1bit_over_hier_1bit_ar": res["flat_1bit"]["s"] / res["hier_1bit_ar"]["s"],
              "wire_hier_fp32_over_hier_1bit": res["hier_fp32"]["wire"] / h1["wire"],
              "telemetry_hier_fp32_over_hier_1bit": (res["hier_fp32"]["telemetry"]["inter_node_bytes"]
                                                     / h1["telemetry"]["inter_node_bytes"]),
              "wire_flat_1bit_over_hier_1bit": res["flat_1bit"]["wire"] / h1["wire"]}
    print(f"\ntime flat 1-bit / hier 1-bit: {ratios['time_flat_1bit_over_hier_1bit']:.2f}x, / hier 1-bit (ar): "
          f"{ratios['time_flat_1bit_over_hier_1bit_ar']:.2f}x (goal >= 2x at 1 Gbit/s); "
          f"inter-node bytes hier fp32 / hier 1-bit: wire {ratios['wire_hier_fp32_over_hier_1bit']:.1f}x, CommStats "
          f"{ratios['telemetry_hier_fp32_over_hier_1bit']:.1f}x (goal >= 30x); wire flat 1-bit / hier 1-bit: "
          f"{ratios['wire_flat_1bit_over_hier_1bit']:.2f}x")
    return ratios


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=25_000_000)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rate", default="1gbit,100mbit", help="tc rate(s) of the inter-node link, comma-separated")
    p.add_argument("--burst", default="512kb")
    p.add_argument("--alpha-us", type=float, default=215.0, help="model: latency per message (docs: measured here)")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--quick", action="store_true", help="2M elements, 1 warm-up + 2 timed iterations")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.numel, args.iters, args.warmup = 2_000_000, 2, 1
    from comm import machine_facts

    facts = machine_facts()
    print(f"# hierarchical 1-bit benchmark, {date.today()}: {facts['cpu']}, nproc {os.cpu_count()}, torch "
          f"{facts['torch']}, python {facts['python']}, load average {facts['loadavg_1_5_15min']}")
    out, compute = {"machine": facts, "numel": args.numel, "rates": {}}, None
    try:
        for rate in args.rate.split(","):
            res = measure(rate, args)
            if compute is None:
                import scale_validation as sv

                compute = {"flat": sv.onebit_compute_rate(args.numel, WORLD),
                           "hier": sv.onebit_compute_rate(-(-args.numel // PER_NODE), NODES)}
                print(f"1-bit compute measured here (one rank alone, collectives skipped, fake group): "
                      f"{compute['flat'] * 1e9:.3f} ns/element ({args.numel:,} on {WORLD} ranks: flat), "
                      f"{compute['hier'] * 1e9:.3f} ns/element ({-(-args.numel // PER_NODE):,} on {NODES}: the shard)")
                out["onebit_compute_s_per_elem"] = compute
            predicted = model(res, rate, args, compute)
            out["rates"][rate] = {"result": res, "model_s": predicted, "ratios": report(rate, res, predicted, args)}
        out["where_it_pays"] = where_it_pays(res, args, compute)
    except NetnsUnavailable as exc:
        print(f"NetnsUnavailable: {exc}; the benchmark needs network namespaces (root + iproute2): skipped")
        return
    from results import save

    save("hierarchy", out, keep=not args.quick)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        n, i, w, hub_name, devs = sys.argv[2:7]
        worker(int(n), int(i), int(w), hub_name, devs.split(","))
    else:
        main()
