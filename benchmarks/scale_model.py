"""Scale model: predicted step time of 1-bit Adam, 0/1 Adam and PowerSGD vs DDP, W = 2..1024.

The alpha-beta model is ``benchmarks/scale_formulas.py`` (its docstring lists the assumptions);
this script prints the tables (markdown), draws the plot and, with ``--validate``, measures fp32
and 1-bit allreduce on 2, 3 and 4 ranks in shaped network namespaces (``scale_validation.py``),
fits alpha and beta on the 2-rank fp32 times and reports the model's error on the rest.

    python benchmarks/scale_model.py                       # tables + scale_model.png (--plot PATH)
    python benchmarks/scale_model.py --measure-compute     # + measure the 1-bit compute rate here
    python benchmarks/scale_model.py --validate            # + netns validation (root + iproute2)
    python benchmarks/scale_model.py --validate-latency --plot ""   # + the latency term: small messages
Options: --alpha-us 20 (inter-node latency per message), --intra-gbyte 100 (GB/s inside a node),
--intra-alpha-us 5, --ranks-per-node 8, --powersgd-rank 4, --zero-one-interval 4, --fwd-bwd-ms 0,
--compute-speedup 1 (divide every compute time: e.g. ~50 for an H100's HBM against this VM).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
import scale_formulas as sf  # noqa: E402

WORLDS = [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
RATES_GBIT = [1, 10, 100]
METHODS = ("onebit_adam", "zero_one_adam", "powersgd")
LABELS = {"onebit_adam": "1-bit Adam", "zero_one_adam": "0/1 Adam", "powersgd": "PowerSGD"}


def topology(world: int, rate_gbit: float, hierarchical: bool, args) -> sf.Topology:
    inter = sf.gbit(rate_gbit, args.alpha_us * 1e-6)
    intra = sf.Link(args.intra_alpha_us * 1e-6, args.intra_gbyte * 1e9) if hierarchical else None
    return sf.Topology(world, inter, intra, args.ranks_per_node)


def predict(models: list[sf.ModelShape], rates: sf.ComputeRates, args) -> list[dict]:
    rows = []
    for model in models:
        for rate in RATES_GBIT:
            for hier in (False, True):
                for world in WORLDS:
                    steps = sf.step_times(model, topology(world, rate, hier, args), rates,
                                          powersgd_rank=args.powersgd_rank, zero_one_interval=args.zero_one_interval,
                                          fwd_bwd_s=args.fwd_bwd_ms * 1e-3)
                    ddp = steps["ddp"].seconds
                    rows.append({"model": model.name, "rate": rate, "hierarchical": hier, "world": world,
                                 "ddp_ms": ddp * 1e3,
                                 **{f"{m}_ms": steps[m].seconds * 1e3 for m in METHODS},
                                 **{f"{m}_speedup": ddp / steps[m].seconds for m in METHODS},
                                 **{f"{m}_inter_MB": steps[m].comm.inter_bytes / 1e6 for m in ("ddp", *METHODS)}})
    return rows


def _series(rows: list[dict], model: str, rate: float, hier: bool) -> list[dict]:
    return [r for r in rows if r["model"] == model and r["rate"] == rate and r["hierarchical"] == hier]


def paying_worlds(series: list[dict], method: str) -> str:
    """The W (of the modelled ones) where the method's step is faster than DDP's, as a range."""
    worlds = [r["world"] for r in series if r[f"{method}_speedup"] >= 1]
    if not worlds:
        return "none"
    return str(worlds[0]) if len(worlds) == 1 else f"{worlds[0]}-{worlds[-1]}"


def speedup_table(rows: list[dict], models: list[str], shown=(2, 8, 64, 1024)) -> str:
    head = "| model | link | topology | " + " | ".join(f"W={w}" for w in shown) + " | 1-bit faster than DDP at W |"
    lines = [head, "|" + "---|" * (4 + len(shown))]
    for model in models:
        for rate in RATES_GBIT:
            for hier in (False, True):
                series = _series(rows, model, rate, hier)
                by_world = {r["world"]: r for r in series}
                cells = [" / ".join(f"{by_world[w][f'{m}_speedup']:.2f}" for m in METHODS) for w in shown]
                lines.append(f"| {model} | {rate} Gbit/s | {'hierarchical' if hier else 'flat'} | "
                             + " | ".join(cells) + f" | {paying_worlds(series, 'onebit_adam')} |")
    return "\n".join(lines)


def hierarchy_table(rows: list[dict], models: list[str], shown=(64, 1024)) -> str:
    """What the hierarchical topology (and the hierarchical 1-bit variant) gains, in step time."""
    lines = ["| model | link | W | DDP flat / hier ms | 1-bit flat / hier ms | 1-bit hier gain | "
             "hier 1-bit vs flat DDP | hier 1-bit vs hier DDP |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for model in models:
        for rate in RATES_GBIT:
            flat = {r["world"]: r for r in _series(rows, model, rate, False)}
            hier = {r["world"]: r for r in _series(rows, model, rate, True)}
            for w in shown:
                f, h = flat[w], hier[w]
                lines.append(f"| {model} | {rate} Gbit/s | {w} | {f['ddp_ms']:.0f} / {h['ddp_ms']:.0f} | "
                             f"{f['onebit_adam_ms']:.0f} / {h['onebit_adam_ms']:.0f} | "
                             f"{f['onebit_adam_ms'] / h['onebit_adam_ms']:.2f}x | "
                             f"{f['ddp_ms'] / h['onebit_adam_ms']:.2f}x | "
                             f"{h['onebit_adam_speedup']:.2f}x |")
    return "\n".join(lines)


def break_even_table(models: list[sf.ModelShape], args) -> str:
    """Flat W from which the 1-bit allreduce's communication alone is slower than the fp32 ring's."""
    lines = ["| model | " + " | ".join(f"{r} Gbit/s" for r in RATES_GBIT) + " |",
             "|---|" + "---:|" * len(RATES_GBIT)]
    for model in models:
        cells = []
        for rate in RATES_GBIT:
            w = sf.comm_break_even_world(model, sf.gbit(rate, args.alpha_us * 1e-6))
            cells.append("> 1,048,576" if w is None else f"{w:,}")
        lines.append(f"| {model.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def bytes_table(rows: list[dict], model: str, shown=(2, 8, 64, 1024)) -> str:
    lines = ["| W | topology | DDP MB | 1-bit MB | 0/1 MB (per step) | PowerSGD MB | DDP / 1-bit |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for hier in (False, True):
        for r in _series(rows, model, RATES_GBIT[0], hier):
            if r["world"] in shown and r["ddp_inter_MB"] > 0:  # hierarchical W <= 8: one node, no inter-node bytes
                ratio = r["ddp_inter_MB"] / r["onebit_adam_inter_MB"]
                lines.append(f"| {r['world']} | {'hierarchical' if hier else 'flat'} | {r['ddp_inter_MB']:.1f} | "
                             f"{r['onebit_adam_inter_MB']:.2f} | {r['zero_one_adam_inter_MB']:.2f} | "
                             f"{r['powersgd_inter_MB']:.2f} | {ratio:.1f}x |")
    return "\n".join(lines)


def plot(rows: list[dict], models: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(RATES_GBIT), 2, figsize=(11, 3.2 * len(RATES_GBIT)), sharex=True)
    colours = {"onebit_adam": "tab:blue", "zero_one_adam": "tab:green", "powersgd": "tab:orange"}
    styles = ["-", "--", ":"]
    for i, rate in enumerate(RATES_GBIT):
        for j, hier in enumerate((False, True)):
            ax = axes[i][j]
            for model, style in zip(models, styles):
                series = _series(rows, model, rate, hier)
                for m in METHODS:
                    ax.plot([r["world"] for r in series], [r[f"{m}_speedup"] for r in series], style,
                            color=colours[m], label=f"{LABELS[m]}, {model}")
            ax.axhline(1.0, color="black", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{rate} Gbit/s, {'hierarchical (8/node)' if hier else 'flat'}", fontsize=9)
            if j == 0:
                ax.set_ylabel("step speedup over DDP")
            if i == len(RATES_GBIT) - 1:
                ax.set_xlabel("ranks W")
    axes[0][1].legend(fontsize=6, ncol=2)
    fig.suptitle("Modelled step (optimizer + communication) speedup over fp32 DDP ring allreduce", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def validate(args) -> list[dict]:
    """Measure 2, 3, 4 ranks, fit alpha/beta on 2 (fp32), report (model - measured) / measured."""
    import scale_validation as sv

    sizes = [int(s) for s in args.sizes.split(",")]
    compute = {n: sv.onebit_compute_rate(n) * n for n in sizes}  # seconds per call, one rank alone
    measured = {w: sv.measure(w, sizes, args.rate) for w in (2, 3, 4)}
    link = sv.fit_link(measured[2])
    print(f"fitted on 2 ranks (fp32, {sizes} elements): alpha {link.alpha_s * 1e6:.0f} us, bandwidth "
          f"{link.bytes_per_s * 8 / 1e9:.3f} Gbit/s; 1-bit compute of one rank alone (measured in-process): "
          + ", ".join(f"{compute[n] * 1e3:.1f} ms at {n:,}" for n in sizes)
          + f"; x {sv.memory_share_slowdown(2):.2f} / {sv.memory_share_slowdown(3):.2f} / "
          f"{sv.memory_share_slowdown(4):.2f} at W = 2 / 3 / 4 (ranks sharing this VM's memory bandwidth)")
    out = []
    for world, by_size in measured.items():
        topo = sf.Topology(world, link)
        for numel, times in by_size.items():
            n = int(numel)
            onebit_comm = sf.onebit_allreduce([n], topo).seconds
            predictions = (("fp32 allreduce", "fp32", sf.allreduce(n, topo).seconds),
                           ("1-bit, whole call", "onebit", onebit_comm + compute[n] * sv.memory_share_slowdown(world)),
                           ("1-bit, inside collectives", "onebit_in_collectives", onebit_comm))
            for label, key, model_s in predictions:
                m = times[key]
                out.append({"world": world, "numel": n, "collective": label, "measured_ms": m * 1e3,
                            "model_ms": model_s * 1e3, "error": (model_s - m) / m,
                            "fitted": world == 2 and key == "fp32"})
    _print_errors(out, "ms", digits=1)
    return out


def _print_errors(rows: list[dict], unit: str, digits: int) -> None:
    """The validation rows as a markdown table (times in ``unit``, the 2-rank fp32 fit marked)."""
    print(f"| W | elements | what | measured {unit} | model {unit} | model error |\n|---|---:|---|---:|---:|---:|")
    for r in rows:
        note = " (fit)" if r["fitted"] else ""
        print(f"| {r['world']} | {r['numel']:,} | {r['collective']} | {r['measured_' + unit]:.{digits}f} | "
              f"{r['model_' + unit]:.{digits}f} | {r['error'] * 100:+.1f}%{note} |")


def validate_latency(args) -> list[dict]:
    """The latency term: small messages (the bytes a few percent of the time) on 2, 3, 4 ranks; alpha
    fitted on 2 ranks' fp32 allreduce with the bandwidth of ``--rate``, then the message counts of the
    model (fp32 ring 2(W-1), 1-bit 3(W-1)) predict 3 and 4 ranks. (This kernel has no netem, so the
    latency is the stack's own: gloo + TCP + veth + bridge, not an injected wide-area delay.)"""
    import scale_validation as sv

    sizes = [int(s) for s in args.latency_sizes.split(",")]
    rate_bits = float(args.rate.lower().removesuffix("gbit")) * 1e9 if args.rate.lower().endswith("gbit") else None
    if rate_bits is None:
        raise SystemExit(f"--rate {args.rate!r}: give it in gbit for --validate-latency")
    measured = {w: sv.measure(w, sizes, args.rate, iters=args.latency_iters, warmup=3) for w in (2, 3, 4)}
    per_byte = 8 / rate_bits
    alphas = [(measured[2][str(n)]["fp32"] - sf.ring_allreduce_bytes(n, 2) * per_byte) / 2 for n in sizes]
    link = sf.Link(statistics.median(alphas), rate_bits / 8)
    print(f"latency fitted on 2 ranks (fp32 allreduce of {sizes} elements, {args.rate}): alpha "
          f"{link.alpha_s * 1e6:.0f} us per message (per size: {', '.join(f'{a * 1e6:.0f}' for a in alphas)} us)")
    out = []
    for world, by_size in measured.items():
        for numel, times in by_size.items():
            n = int(numel)
            for label, key, model_s in (("fp32 allreduce", "fp32", sf._ring_allreduce(n, world, link).seconds),
                                        ("1-bit, inside collectives", "onebit_in_collectives",
                                         sf._onebit([n], world, link).seconds)):
                m = times[key]
                out.append({"world": world, "numel": n, "collective": label, "measured_us": m * 1e6,
                            "model_us": model_s * 1e6, "error": (model_s - m) / m,
                            "fitted": world == 2 and key == "fp32"})
    _print_errors(out, "us", digits=0)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--alpha-us", type=float, default=20.0)
    p.add_argument("--intra-gbyte", type=float, default=100.0)
    p.add_argument("--intra-alpha-us", type=float, default=5.0)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--powersgd-rank", type=int, default=4)
    p.add_argument("--zero-one-interval", type=int, default=4)
    p.add_argument("--fwd-bwd-ms", type=float, default=0.0)
    p.add_argument("--compute-speedup", type=float, default=1.0)
    p.add_argument("--measure-compute", action="store_true")
    p.add_argument("--validate", action="store_true")
    p.add_argument("--rate", default="1gbit", help="tc rate of the --validate links")
    p.add_argument("--sizes", default="8000000,32000000", help="--validate tensor sizes (elements)")
    p.add_argument("--validate-latency", action="store_true", help="small messages on 2-4 shaped ranks: alpha")
    p.add_argument("--latency-sizes", default="256,1024,4096")
    p.add_argument("--latency-iters", type=int, default=30)
    p.add_argument("--plot", default="scale_model.png", help="where the plot goes (\"\": no plot)")
    p.add_argument("--json", default=None, help="write every predicted row (and the validation) here")
    args = p.parse_args(argv)

    rates = sf.MEASURED_HERE
    if args.measure_compute or args.validate or args.validate_latency:
        from comm import machine_facts

        facts = machine_facts()
        print(f"machine: {facts['cpu']}, {facts['cores']} cores, torch {facts['torch']}, python {facts['python']}, "
              f"load average {facts['loadavg_1_5_15min']}")
        import scale_validation as sv

        per_elem = sv.onebit_compute_rate(8_000_000)
        rates = sf.ComputeRates(rates.adam_s_per_param, per_elem, rates.stream_bytes_per_s)
        print(f"measured here: 1-bit compressed_allreduce compute {per_elem * 1e9:.3f} ns/element "
              f"(8M fp32, W=2, 1 thread, collectives skipped)")
    validation = validate(args) if args.validate else None
    if args.validate_latency:
        validation = {"bandwidth": validation, "latency": validate_latency(args)}
    rates = rates.scaled(args.compute_speedup)
    models = sf.default_models()
    names = [m.name for m in models]
    print("models: " + ", ".join(f"{m.name} {m.numel / 1e6:.1f}M params in {len(m.shapes)} tensors" for m in models))
    print(f"compute: AdamW {rates.adam_s_per_param * 1e9:.3f} ns/param, 1-bit {rates.onebit_s_per_elem * 1e9:.3f} "
          f"ns/elem, stream {rates.stream_bytes_per_s / 1e9:.1f} GB/s; inter alpha {args.alpha_us} us, intra "
          f"{args.intra_gbyte} GB/s alpha {args.intra_alpha_us} us, {args.ranks_per_node} ranks/node, "
          f"PowerSGD rank {args.powersgd_rank}, 0/1 interval {args.zero_one_interval}, fwd+bwd {args.fwd_bwd_ms} ms")
    rows = predict(models, rates, args)
    print("\nspeedup of the step over DDP (1-bit Adam / 0/1 Adam / PowerSGD):\n")
    print(speedup_table(rows, names))
    print("\nhierarchical (8 ranks/node on the fast link; 1-bit: fp32 reduce-scatter in the node, 1-bit among "
          "nodes on the shard, fp32 all-gather in the node):\n")
    print(hierarchy_table(rows, names))
    print("\nflat W from which the 1-bit allreduce's communication alone is slower than the fp32 ring's:\n")
    print(break_even_table(models, args))
    print(f"\nbytes sent per rank per step on the inter-node link, {names[0]}:\n")
    print(bytes_table(rows, names[0]))
    if args.plot:
        plot(rows, names[:2], args.plot)
        print(f"\nplot: {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "validation": validation}, f, indent=1)


if __name__ == "__main__":
    main()
