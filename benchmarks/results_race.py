"""Results page section of the low-communication race (``benchmarks/lowcomm_race.py``): one table, one figure."""

from __future__ import annotations

from results_format import f, pct, reading, table, x

DDP = "DDP"  # lowcomm_race.py's label of the baseline


def _reach(r: dict) -> str:
    """Time to DDP's final loss as a multiple of DDP's training time, with the seconds."""
    if r["vs_ddp_pct"] is None:  # no DDP run at this rate to set it against
        return "-"
    if r["time_to_ddp_loss_s"] is None:
        return "never"
    return f"{x(r['time_to_ddp_loss_x'])} ({f(r['time_to_ddp_loss_s'], 1)} s)"


def ddp_loss_at(ddp: dict, seconds: float) -> float | None:
    """DDP's validation loss after ``seconds`` of training, interpolated linearly between its validations (None past
    its last one)."""
    points = list(zip(ddp["train_s"], ddp["val_loss"]))
    for (t0, v0), (t1, v1) in zip(points, points[1:]):
        if t0 <= seconds <= t1:
            return v0 if t1 == t0 else v0 + (v1 - v0) * (seconds - t0) / (t1 - t0)
    return None


def _same_time(r: dict, ddp: dict | None) -> str:
    """The method's final loss against DDP's after the same training time."""
    if r is ddp:
        return ""
    if ddp is None:  # no DDP run at this rate to set it against
        return "-"
    at = ddp_loss_at(ddp, r["train_s"][-1])
    return "-" if at is None else pct((r["final_val_loss"] / at - 1) * 100, 2, sign=True)


def race_table(d: dict) -> list[str]:
    rows = []
    for rate, per_rate in d["rates"].items():
        ddp_row = next((r for r in per_rate["rows"] if r["label"] == DDP), None)
        for i, r in enumerate(per_rate["rows"]):
            ddp = r["label"] == DDP
            rows.append([rate if i == 0 else "", r["label"], ("~" if r["bytes_computed"] else "")
                         + f(r["sent_mb_per_rank"], 1), "" if ddp else x(r["fewer_x"], 1), f(r["final_val_loss"], 4),
                         "" if ddp else pct(r["vs_ddp_pct"], 2, sign=True), _reach(r), _same_time(r, ddp_row)])
    return table(["link", "method", "MB sent per rank", "fewer bytes than DDP", "final val loss",
                  "vs DDP (equal tokens)", "time to DDP's final loss (x DDP's training time)",
                  "vs DDP after the same training time"], rows, "llrrrrlr")


def race_method(d: dict) -> str:
    recipe = "; ".join(f"{label}: `{' '.join(overrides)}`" for label, overrides in d["recipe"].items())
    rates = ", ".join(f"`{rate}`" for rate in d["rates"])
    return (f"The main job (`lightning_optim.train`) on {d['world_size']} ranks, each in its own network namespace, "
            f"the veth between them shaped with `tc tbf` to {rates} in turn; the `{d['model']}` model "
            f"({d['num_params'] / 1e6:.2f}M params), {d['steps']} steps at equal tokens (same batches, seed and inner "
            f"AdamW with its schedule for every method), {d['threads']} torch thread(s) per rank, validation every "
            f"{d['val_every']} steps and once before training. The recipe (the strategies' Hydra overrides): "
            f"{recipe}. MB sent per rank: the library's own count (`comm_stats()`) over the whole run, a "
            "synchronisation at the end of the fit included; DDP's all-reduce is Lightning's and counts nothing, so "
            "its bytes are the ring rule's, 2(W-1)/W x 4 bytes per parameter per step (marked ~). Training time: the "
            "slower rank's sum of its per-step wall times (the exchanges inside the steps included, validation left "
            "out). Time to DDP's final loss: the first validation at or under DDP's final validation loss at the same "
            "rate, its time interpolated linearly between the two validations that bracket the crossing, divided by "
            "DDP's whole training time; never: not reached within the steps. After the same training time: the "
            "method's final loss against DDP's validation loss interpolated at the method's whole training time (a "
            "method that trains faster than DDP ends earlier; - where DDP had not trained that long).")


def _reading(d: dict) -> str:
    parts = []
    for rate, per_rate in d["rates"].items():
        others = [r for r in per_rate["rows"] if r["label"] != DDP and r["vs_ddp_pct"] is not None]
        if not others:
            continue
        reached = sorted((r for r in others if r["time_to_ddp_loss_x"] is not None),
                         key=lambda r: r["time_to_ddp_loss_x"])
        closest = min(others, key=lambda r: r["vs_ddp_pct"])
        frugal = [r for r in others if r["fewer_x"] is not None and r["fewer_x"] >= 100]
        best_frugal = min(frugal, key=lambda r: r["vs_ddp_pct"]) if frugal else None
        text = (f"at `{rate}`, " + (f"{reached[0]['label']} reaches DDP's final loss first, in "
                                     f"{x(reached[0]['time_to_ddp_loss_x'])} DDP's time" if reached
                                     else "no method reaches DDP's final loss within the steps")
                + f"; the closest final loss is {closest['label']}'s ({pct(closest['vs_ddp_pct'], 2, sign=True)}, "
                  f"with {x(closest['fewer_x'], 0)} fewer bytes)"
                + ("" if best_frugal is None else
                   f"; of the methods sending at least 100x fewer bytes, {best_frugal['label']} ends closest "
                   f"({pct(best_frugal['vs_ddp_pct'], 2, sign=True)} with {x(best_frugal['fewer_x'], 0)} fewer)"))
        parts.append(text)
    if not parts:
        return "Without a DDP run there is nothing to set the methods against."
    return ("The race is won on time to DDP's loss, not on bytes alone: " + "; ".join(parts) + ". The figure shows "
            "where each curve crosses DDP's final loss (dashed) and what each method had sent by then.")


def race_body(rec: dict) -> list[str]:
    d = rec["data"]
    return [race_method(d), "", *race_table(d),
            "![validation loss against training time per link, and against MB sent](lowcomm_race.png)", "",
            *reading(_reading(d))]


def race_plot(plt, rec: dict) -> list:
    d = rec["data"]
    rates = list(d["rates"])
    labels = list(dict.fromkeys(r["label"] for per_rate in d["rates"].values() for r in per_rate["rows"]))
    colour = {label: f"C{i}" for i, label in enumerate(labels)}
    fig, axes = plt.subplots(1, len(rates) + 1, figsize=(5 * (len(rates) + 1), 4.2), squeeze=False)
    for ax, rate in zip(axes[0], rates):
        rows = d["rates"][rate]["rows"]
        for r in rows:
            ax.plot(r["train_s"], r["val_loss"], marker=".", color=colour[r["label"]], label=r["label"])
        ddp = next((r for r in rows if r["label"] == DDP), None)
        if ddp:
            ax.axhline(ddp["final_val_loss"], color="grey", linestyle="--", linewidth=0.8)
        ax.set_title(f"link {rate}", fontsize=10)
        ax.set_xlabel("training time, s (slower rank, validation left out)")
    ax_bytes = axes[0][-1]
    for r in d["rates"][rates[0]]["rows"]:  # the bytes do not depend on the link: the first rate's runs
        sent = [(mb, loss) for mb, loss in zip(r["sent_mb"], r["val_loss"]) if mb > 0]
        ax_bytes.plot([mb for mb, _ in sent], [loss for _, loss in sent], marker=".", color=colour[r["label"]],
                      label=r["label"])
    ax_bytes.set_xscale("log")
    ax_bytes.set_title(f"bytes sent (runs at {rates[0]})", fontsize=10)
    ax_bytes.set_xlabel("MB sent per rank so far (log scale; DDP's by the ring rule)")
    low = min(min(r["val_loss"]) for per_rate in d["rates"].values() for r in per_rate["rows"])
    high = max(r["val_loss"][1] if len(r["val_loss"]) > 1 else r["val_loss"][0]
               for per_rate in d["rates"].values() for r in per_rate["rows"])
    for ax in axes[0]:
        ax.set_ylim(low - 0.05 * (high - low), high)  # the untrained start (the first point) off the scale
        ax.set_ylabel("validation loss (nats per byte)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    return [("lowcomm_race.png", fig)]
