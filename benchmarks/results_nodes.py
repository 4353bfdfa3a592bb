"""Results page sections across ranks and nodes: HSDP, the hierarchy, the compressors, DiLoCo."""

from __future__ import annotations

from results_format import MB, f, pct, reading, table, x

HSDP_LABELS = {"adamw": "HSDP + torch AdamW", "onebit_warmup": "HSDP + OnebitAdam, warmup (fp32)",
               "onebit": "HSDP + OnebitAdam, 1-bit stage", "idle": "barriers only"}


def hsdp_body(rec: dict) -> list[str]:
    d = rec["data"]
    a = d["args"]
    rows = []
    for rate, per_rate in d["rates"].items():
        res = per_rate["result"]
        for i, (key, label) in enumerate(HSDP_LABELS.items()):
            r = res[key]
            kind = {"adamw": "fp32", "onebit_warmup": "fp32", "onebit": "onebit"}.get(key)
            digits = 3 if key == "idle" else 2
            counted = {"idle": "", "adamw": "- (torch's own)"}.get(key, f(r["sent"] / MB, 2))
            rows.append([rate if i == 0 else "", label, f(r["inter"] / MB, digits),
                         f(res["expected_inter"][kind] / MB, 2) if kind else "",
                         f((r["all"] - r["inter"]) / MB, digits), counted, f(r["s"] * 1e3, 0) if key != "idle" else ""])
    mem = d.get("memory", {})
    mem_rows = [[label, f"{mem[k]['params']:,}", f(mem[k]["state"] / MB), f(mem[k]["errors"] / MB),
                 f((mem[k]["state"] + mem[k]["errors"]) / MB), f(mem[k]["scratch"] / MB)]
                for k, label in (("hsdp_adamw", "torch AdamW, HSDP 2 x 2"), ("hsdp_onebit", "OnebitAdam, HSDP 2 x 2"),
                                 ("ddp_onebit", "OnebitAdam, whole model on 4 ranks (DDP)")) if k in mem]
    first = next(iter(d["rates"].values()))["ratios"]
    return ["4 gloo ranks as 2 nodes x 2 in network namespaces: the ranks of a node on an unshaped bridge, each "
            "node's uplink shaped with `tc tbf`. HSDP mesh (replicate 2, shard 2): the shard group is a node, the "
            "replicate group crosses the uplinks. The main job's `small` ByteGPT, `fully_shard` on every block and "
            f"the root, batch {a['batch']} x {a['seq']} per rank; in the same processes, step by step: HSDP + torch "
            "AdamW, HSDP + OnebitAdam (`onebit_fsdp`) before `freeze_step` and past it. Per step: inter-node = the "
            "uplinks' tx bytes (frames and headers included), intra-node = the rest of the ranks' traffic; expected "
            "= a 2-rank ring all-reduce of each shard (fp32) or `compressed_bytes` (1-bit), summed over ranks; "
            f"`comm_stats` = the library's own count, summed over ranks; step time: the slowest rank, median of "
            f"{a['iters']} after {a['warmup']}.", "",
            *table(["uplinks", "variant", "inter-node MB/step", "expected MB", "intra-node MB/step",
                    "comm_stats MB/step", "step ms"], rows, "llrrrrr"),
            "Optimizer state held per rank (the storages behind the state tensors, the 1-bit error buffers, and the "
            "work buffers apart):", "",
            *table(["optimizer", "param elements per rank", "moments MB", "error buffers MB", "state MB",
                    "work buffers MB"], mem_rows, "lrrrrr"),
            *reading(f"Across the uplinks the 1-bit stage sends {x(first['inter_wire_adamw_over_onebit'], 1)} fewer "
                     "bytes than HSDP + AdamW (32x is the ceiling: one bit per element plus scales and framing), "
                     "while the shard group's all-gathers and reduce-scatters stay inside the nodes. "
                     + (f"Sharding divides the 1-bit state per rank: HSDP / DDP = {f(mem['hsdp_over_ddp'], 3)}."
                        if "hsdp_over_ddp" in mem else ""))]


HIER_LABELS = {"flat_1bit": "flat 1-bit (`OnebitCompressor`, 4 ranks)", "hier_1bit": "hierarchical 1-bit",
               "hier_1bit_ar": "hierarchical 1-bit, node collectives as all_reduce (not in the library)",
               "hier_fp32": "hierarchical fp32 (the warmup's average)", "flat_fp32": "flat fp32 all_reduce",
               "node_fp32": "node fp32 all_reduce only", "node_rsag": "node reduce-scatter + all-gather only"}


def hierarchy_body(rec: dict) -> list[str]:
    d = rec["data"]
    rates = list(d["rates"])
    rows = []
    for key, label in HIER_LABELS.items():
        first = d["rates"][rates[0]]["result"][key]
        tel = first["telemetry"]["inter_node_bytes"]
        measured = []
        for r in rates:
            took, model = d["rates"][r]["result"][key]["s"], d["rates"][r]["model_s"].get(key)
            measured.append(f(took * 1e3, 0) + (f" ({100 * (model - took) / took:+.0f}%)" if model else ""))
        rows.append([label, *measured, f(first["wire"] / MB, 2),
                     f(tel / MB, 2) if key.startswith(("hier", "flat_1")) else "-"])
    pays = [[r["intra"], f"{r['inter_gbit']} Gbit/s", r["ranks"], f(r["flat_ms"], 1), f(r["hier_ms"], 1),
             x(r["flat_ms"] / r["hier_ms"])] for r in d.get("where_it_pays", [])]
    ratios = d["rates"][rates[0]]["ratios"]
    return [f"4 ranks as 2 nodes x 2 in network namespaces (node ranks on a bridge, each node's uplink shaped with "
            f"`tc tbf`). One flat fp32 buffer of {d['numel']:,} elements, reset before every call; the slowest rank's "
            "median, in brackets the error of the alpha-beta model (`benchmarks/scale_formulas.py`, its node link fitted "
            "on the node-only rows) against it. Inter-node MB: the uplinks' tx bytes (headers and barriers included) "
            "at the first rate; CommStats: the library's own count of inter-node bytes, summed over ranks.", "",
            *table(["exchange", *[f"{r}: ms" for r in rates], "inter-node wire MB", "CommStats inter-node MB"], rows,
                   "l" + "r" * (len(rates) + 2)),
            "Where it pays, predicted by the same model: the node link fitted here or a PCIe- or NVLink-class one, "
            "the 1-bit compute at the rate measured here (fitted rows) or 50x faster (a GPU's memory bandwidth):", "",
            *table(["node link", "inter-node link", "ranks", "flat 1-bit ms", "hier 1-bit ms", "flat / hier"], pays,
                   "lrlrrr"),
            *reading(f"Hierarchical 1-bit puts {x(ratios['wire_flat_1bit_over_hier_1bit'])} fewer bytes on the uplinks "
                     f"than flat 1-bit and {x(ratios['wire_hier_fp32_over_hier_1bit'], 1)} fewer than hierarchical "
                     "fp32; it is faster only where the node link is far faster than the uplink (GPU nodes), because "
                     "it moves the whole fp32 buffer through the node link first: on this machine's veth bridge flat "
                     f"1-bit takes {x(1 / ratios['time_flat_1bit_over_hier_1bit'])} less time.")]


# ----------------------------------------------------------------------------- strategies on the main job
def strategies_table(d: dict) -> list[str]:
    rows = []
    for r in d["rows"]:
        nominal = r["label"] == "fp32 DDP"  # Lightning's own all-reduce: the ring rule's bytes, not a counter
        reached = f"{f(r['time_to_loss_s'], 1)} s (step {r['reached_step'] + 1})" if r["time_to_loss_s"] else "never"
        rows.append([r["label"], ("~" if nominal else "") + f(r["payload_mb"], 1), x(r["fewer_x"], 1),
                     f(r["wire_mb"], 1), f(r["median_step_ms"], 0), f(r["final_val_loss"], 4),
                     pct(r["vs_fp32_pct"], 2, sign=True) if not nominal else "", reached])
    return table(["strategy", "payload MB/rank", "fewer bytes than DDP", "wire MB/rank", "median step ms",
                  "final val loss", "vs fp32 DDP", "time to DDP's loss + 2%"], rows, "lrrrrrrl")


def strategies_method(d: dict) -> str:
    return (f"The main job (`lightning_optim.train`, Hydra overrides per strategy) on 2 ranks in {d['where']}, the "
            f"`{d['model']}` model ({d['num_params'] / 1e6:.2f}M params), {d['steps']} steps at equal tokens (every "
            "configuration sees the same batches; the optimizer is the job's AdamW with its schedule), validation "
            f"every {d['steps'] // 10} steps. Payload: what the library's collectives counted (`comm_stats()`; plain "
            "DDP's own all-reduce is not counted there, its figure is the ring rule's, marked ~). Wire: the veth's "
            "tx counter (TCP/IP framing and DDP's start-up broadcasts included). Step: the slower rank's median. "
            "Time to loss: the first validation at or under fp32 DDP's final loss + 2%, times the mean step.")


def compressors_body(rec: dict) -> list[str]:
    d = rec["data"]
    best = min((r for r in d["rows"] if r["label"] != "fp32 DDP"), key=lambda r: r["final_val_loss"])
    return [strategies_method(d), "", *strategies_table(d),
            *reading(f"Bytes per rank fall with every compressor; at this model size the step is mostly compute, so "
                     f"the loss decides: the lowest final loss is {best['label']}'s "
                     f"({pct(best['vs_fp32_pct'], 2, sign=True)} against fp32 DDP).")]


def diloco_body(rec: dict) -> list[str]:
    d = rec["data"]
    rows = [[r["label"], f"{f(r['send_step_ms'][0], 0)} / {f(r['send_step_ms'][1], 0)}",
             f"{f(r['merge_step_ms'][0], 0)} / {f(r['merge_step_ms'][1], 0)}", f(r["quiet_step_ms"], 0),
             x(r["slowest_send_vs_quiet"]), f(r["peak_step_mb"], 2)]
            for r in d["rows"] if "send_step_ms" in r]
    by = {r["label"]: r for r in d["rows"]}
    diloco = [r for r in d["rows"] if "DiLoCo" in r["label"]]
    return [strategies_method(d), "", *strategies_table(d),
            "The steps that send, for the strategies that send only now and then (slower rank per step); peak MB: "
            "the most one step sends:", "",
            *table(["strategy", "sending steps: median / slowest ms", "the step after: median / slowest ms",
                    "quiet steps: median ms", "slowest sending / quiet", "peak MB in a step"], rows, "lrrrrr"),
            "![validation loss against bytes sent and against training time](diloco_loss.png)", "",
            *reading("DiLoCo sends its outer gradient once every `sync_every` steps: "
                     + ", ".join(f"{r['label']} sends {x(r['fewer_x'], 0)} fewer bytes than DDP and ends "
                                 f"{pct(r['vs_fp32_pct'], 1, sign=True)} from its loss" for r in diloco)
                     + (f"; 1-bit Adam ends {pct(by['1-bit Adam']['vs_fp32_pct'], 2, sign=True)} with "
                        f"{x(by['1-bit Adam']['fewer_x'], 0)} fewer bytes" if "1-bit Adam" in by else "")
                     + ". These runs use the papers' outer step (lr 0.7, Nesterov momentum 0.9); the tuned recipe "
                       "and its race are in the sections below.")]


def diloco_plot(plt, rec: dict) -> list:
    fig, (ax_bytes, ax_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in rec["data"]["rows"]:
        steps = [step for step, _ in r["val_curve"]]
        losses = [loss for _, loss in r["val_curve"]]
        sent = [(b, v) for b, v in zip(r["sent_mb_curve"][1:], losses[1:]) if b > 0]
        ax_bytes.plot([b for b, _ in sent], [v for _, v in sent], marker=".", label=r["label"])
        ax_time.plot([(s + 1) * r["mean_step_ms"] / 1e3 for s in steps], losses, marker=".", label=r["label"])
    ax_bytes.set_xscale("log")
    ax_bytes.set_xlabel("MB sent per rank so far (log scale)")
    ax_time.set_xlabel("training time, s (mean step x steps)")
    for ax in (ax_bytes, ax_time):
        ax.set_ylabel("validation loss")
        ax.grid(alpha=0.3)
    ax_time.legend(fontsize=7)
    return [("diloco_loss.png", fig)]
