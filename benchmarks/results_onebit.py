"""Results page sections of the 1-bit family: the exchange, the training step, convergence, precision."""

from __future__ import annotations

from results_format import MB, f, pct, reading, span, table, x


def comm_body(rec: dict) -> list[str]:
    d = rec["data"]
    rows = [["time, ms (slower rank)", f(d["fp32_ms"], 1), f(d["onebit_ms"], 1), x(d["time_ratio"])],
            ["of which inside collectives, ms", "-", f(d["onebit_in_collectives_ms"], 1), ""],
            ["bytes sent per rank, MB", f(d["fp32_bytes_per_rank"] / MB), f(d["onebit_bytes_per_rank"] / MB),
             x(d["bytes_ratio"])]]
    return [f"{d['numel']:,} fp32 elements on 2 gloo ranks, one torch thread each, in {d['mode']}; median of "
            f"{d['iters']} calls after {d['warmup']} warm-up, each time the slower rank's. fp32 is `allreduce_mean` "
            "(gloo's `all_reduce` and a divide); 1-bit is `compressed_allreduce` with error feedback, compression "
            "and decompression included (the compiled kernels).", "",
            *table(["", "fp32 all-reduce", "1-bit", "fp32 / 1-bit"], rows, "lrrr"),
            *reading("The bytes are one bit per element plus each segment's sizes and scales, so 32x is the "
                     "ceiling; the time ratio is what that buys on this link once compression is paid for.")]


def onebit_step_body(*records: dict) -> list[str]:
    rows = []
    for rec in records:
        d = rec["data"]
        ms, opt = d["ms"], d["optimizer_ms"]
        rows.append([f"{d['batch']} x {d['seq_len']}", d["steps_per_stage"] * 1, f(ms["ddp"], 1), f(opt["ddp"], 1),
                     f(ms["warmup"], 1), f(ms["compression"], 1), f(opt["compression"], 1), x(d["ratio"])])
    d = records[0]["data"]
    return [f"Real `Trainer` steps of the main job's `{d['model']}` model ({d['params'] / 1e6:.1f}M params) on random "
            f"bytes, 2 ranks in {d['mode']}, one thread each. Per stage the median of the slower rank (the first 2 "
            "steps of each stage left out); \"optimizer\" is the part from `on_before_optimizer_step` to the end "
            "of the step (clipping, `step()` and its collectives).", "",
            *table(["tokens per rank", "steps per stage", "DDP + AdamW, ms", "of which optimizer",
                    "OnebitAdam warmup, ms", "OnebitAdam 1-bit stage, ms", "of which optimizer", "DDP / 1-bit stage"],
                   rows, "lrrrrrrr"),
            *reading("Where the step is bound by the wire (few tokens per rank) the 1-bit stage is several times "
                     "faster than DDP; with more compute per step the gain shrinks to what the wire took of DDP's "
                     "step. The warmup stage runs at DDP's speed.")]


def onebit_compute_body(rec: dict) -> list[str]:
    d = rec["data"]
    rows = [["`lightning_optim.AdamW` step", f(d["adamw_ms"]), "ref"],
            ["`OnebitAdam` 1-bit-stage step", f(d["onebit_ms"]), x(d["onebit_ms"] / d["adamw_ms"])],
            ["of which inside the collectives", f(d["in_collectives_ms"]), ""],
            ["compute (the step less its collectives)", f(d["compute_ms"]), x(d["compute_ms"] / d["adamw_ms"])]]
    return [f"2 gloo ranks on loopback, {d['threads']} thread each, {d['numel'] / 1e6:.1f}M params in {d['tensors']} "
            "tensors (a GPT-2-like layout); per round one AdamW step and one OnebitAdam step past `freeze_step` on the "
            "same params; the time inside the collectives (waiting for the other rank included) is taken off the "
            f"1-bit step. Medians of {d['steps']} rounds after {d['skip']}, slower rank; kernels: {d['backend']}.", "",
            *table(["", "ms", "ratio"], rows, "lrr"),
            *reading("The 1-bit step must update the momentum and take each param's norm before any sign can be "
                     "packed, run the server's average and unpack the result: about 56 bytes of memory traffic per "
                     "param at 2 ranks against AdamW's 28, so 2x AdamW's compute is this algorithm's floor at equal "
                     "bandwidth.")]


def overlap_body(rec: dict) -> list[str]:
    d = rec["data"]
    ms = d["ms"]
    rows = [[name, f(ms[key], 1), x(ms[key] / ms["nocomm"])] for name, key in (
        ("DDP + AdamW", "ddp"), ("OnebitAdam, not overlapped (exchange at `step()`)", "compression"),
        ("OnebitAdam, overlapped (`overlap=True`: exchange from DDP's comm hook)", "overlap"),
        ("OnebitAdam, overlapped, collectives replaced by local copies (no comm)", "nocomm"))]
    return [f"The Trainer runs of the step-time section ({d['batch']} x {d['seq_len']} tokens per rank, {d['mode']}), "
            "plus the 1-bit stage with the exchange overlapped with backward, and the same with nothing on the wire "
            "(every pass computed on real data, the collectives replaced by local copies of the right shape). "
            f"Medians of the slower rank, all runs interleaved per repeat ({d['repeats']} repeats).", "",
            *table(["run", "step ms", "/ no comm"], rows, "lrr"),
            *reading(f"The overlapped 1-bit step took {x(ms['overlap'] / ms['compression'])} the time of the plain "
                     f"one, and the run with nothing on the wire {x(ms['nocomm'] / ms['compression'])}: at this model "
                     "size the 1-bit exchange is a few milliseconds on the wire, within the spread of these runs, so "
                     "there is little to hide; and on 2 cores each rank has one, which the exchange's compression "
                     "passes take from backward. Overlap pays where a rank has a core (or a GPU stream) to spare and "
                     "the wire time is large against a step.")]


def compile_breaks_body(rec: dict) -> list[str]:
    d = rec["data"]
    rows = [[r["optimizer"], r["phase"], r["graphs"], r["breaks"], r["ours"]] for r in d["rows"]]
    reasons = sorted({reason for r in d["rows"] for reason in r["reasons"]})
    return ["`torch.compile` of a whole training step (forward, backward, `optimizer.step()`, `zero_grad()`) of a "
            "3-layer MLP; graph breaks counted from dynamo's `graph_breaks` log; \"in lightning_optim\": breaks "
            f"whose frame is in the library. Kernels: {d['backend']}.", "",
            *table(["optimizer", "step", "graphs", "graph breaks", "in lightning_optim"], rows, "llrrr"),
            "The breaks found:", "", *[f"- {reason}" for reason in reasons], "",
            *([f"AdamW's eager step on 2000 tensors of 5000 elements in the same run: {f(d['eager_adamw_ms'])} ms "
               "(median).", ""] if "eager_adamw_ms" in d else []),
            *reading("The first step creates the states in a disabled function (a one-off); later steps break only "
                     "where torch itself does (`Tensor.backward()`), with the optimizer's kernel one node of the "
                     "graph.")]


def auto_freeze_body(rec: dict) -> list[str]:
    d = rec["data"]
    rows = []
    for workload, label in (("main_job", "main job, final val loss"), ("hf_example", "HF example, final eval loss")):
        if workload not in d:
            continue
        w = d[workload]
        by = w["rows"]
        fixed = [k for k in by if k != "auto"]
        rows.append([label, *[f(by[k]["loss"], 4) for k in fixed], f"{f(by['auto']['loss'], 4)} ({by['auto']['switch']})",
                     pct(100 * w["loss_gap"], 2, sign=True), x(w["switch_ratio"])])
    keys = [k for k in next(d[w] for w in ("main_job", "hf_example") if w in d)["rows"] if k != "auto"]
    return ["Each workload once per setting, everything else equal: the main job (1-bit Adam, 2 processes, "
            "`strategy.freeze_step=N|auto`) and `examples/hf_trainer_onebit.py` under `torchrun --nproc_per_node 2` "
            "(`--optim_args freeze_step=N|auto`). The fixed settings are shares of the run.", "",
            *table(["workload", *keys, "auto (switch step)", "auto vs the best fixed", "switch vs the best fixed's"],
                   rows, "l" + "r" * (len(keys) + 3)),
            *reading("`freeze_step=\"auto\"` switches once the variance's norm has settled (capped at 15% of the run "
                     "where its length is known); a switch that comes too early costs the most loss.")]


CONVERGENCE_PAIRS = (("OnebitAdam", "AdamW + DDP"), ("ZeroOneAdam", "AdamW + DDP"), ("OnebitLamb", "FusedLamb + DDP"))


def convergence_body(rec: dict) -> list[str]:
    runs = rec["data"]["runs"]
    base_of = {one: base for one, base in CONVERGENCE_PAIRS}
    rows = []
    for name, run in runs.items():
        s = run["summary"]
        comm = s.get("comm") or {}
        base = base_of.get(name)
        gap = 100 * (s["final_val_loss"] / runs[base]["summary"]["final_val_loss"] - 1) if base in runs else None
        sent = comm.get("bytes_sent")
        fp32 = comm.get("fp32_bytes")
        rows.append([name, "`" + " ".join(run["overrides"]) + "`", f(s["initial_val_loss"], 3), f(s["final_val_loss"], 4),
                     pct(gap, 2, sign=True) if base else "", f(sent / MB, 1) if sent else "-",
                     x(fp32 / sent, 1) if sent and fp32 else "-", f(run["wall_s"], 0)])
    gaps = [100 * (runs[a]["summary"]["final_val_loss"] / runs[b]["summary"]["final_val_loss"] - 1)
            for a, b in CONVERGENCE_PAIRS if a in runs and b in runs]
    s0 = next(iter(runs.values()))["summary"]
    return ["The main job (`python -m lightning_optim.train`: ByteGPT on the bundled text, 2 processes over gloo, "
            f"{s0.get('steps', '?')} steps, the same seed, data and schedule in every run), each 1-bit strategy against "
            "the same optimizer under Lightning's plain DDP. Bytes are what the strategy's collectives sent per rank "
            "over the whole run (`comm_stats()`), against the fp32 all-reduce of the same steps.", "",
            *table(["run", "overrides", "first val loss", "final val loss", "vs its baseline", "MB sent per rank",
                    "fewer bytes than fp32", "wall s"], rows, "llrrrrrr"),
            "![validation loss of each 1-bit optimizer and its baseline](convergence.png)", "",
            *reading(f"The 1-bit runs end {span(gaps, lambda v: pct(v, 2, sign=True))} from their full-precision "
                     "baselines at equal steps; they send fewer bytes over the run than the fp32 all-reduce because "
                     "every step after `freeze_step` sends one bit per element (32x less than fp32).")]


def convergence_plot(plt, rec: dict) -> list:
    runs = rec["data"]["runs"]
    pairs = [(a, b) for a, b in CONVERGENCE_PAIRS if a in runs and b in runs]
    fig, axes = plt.subplots(1, len(pairs), figsize=(5 * len(pairs), 4), sharey=True, squeeze=False)
    for ax, (onebit, base) in zip(axes[0], pairs):
        for name, style in ((base, "o-"), (onebit, "s--")):
            steps, losses = zip(*runs[name]["val_curve"])
            ax.plot(steps, losses, style, markersize=3, label=f"{name}: {losses[-1]:.3f}")
        ax.set_title(f"{onebit} vs {base}", fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0][0].set_ylabel("validation loss (nats per byte)")
    return [("convergence.png", fig)]


def precision_body(rec: dict) -> list[str]:
    d = rec["data"]
    rows = [[r["run"], "`" + " ".join(d["runs"][r["run"]]["overrides"]) + "`", f(r["final_val"], 4),
             "" if r["run"] == "32-true" else pct(100 * r["gap"], 2, sign=True),
             f(d["runs"][r["run"]]["summary"].get("train_tokens_per_sec"), 0)] for r in d["table"]]
    return ["The main job in one process (`strategy=auto trainer.devices=1`), its AdamW and schedule, the same seed and "
            f"data, `{' '.join(d['overrides'])}`; each precision option against fp32 (`32-true`). On a CPU without "
            "fp16 arithmetic the fp16 run is slow: compare the losses, not the speeds.", "",
            *table(["run", "overrides", "final val loss", "vs 32-true", "train tokens/s"], rows, "llrrr"),
            "![validation loss of the precision options](precision_convergence.png)", "",
            *reading("Differences of about a percent are the trajectory noise of 16-bit rounding at this learning "
                     "rate; Kahan summation matters where updates are small next to a bf16 ulp.")]


def precision_plot(plt, rec: dict) -> list:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (name, run), style in zip(rec["data"]["runs"].items(), ("o-", "s--", "^--", "x:")):
        steps, losses = zip(*run["val_curve"])
        ax.plot(steps, losses, style, markersize=3, label=f"{name}: {losses[-1]:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats per byte)")
    ax.grid(alpha=0.3)
    ax.legend()
    return [("precision_convergence.png", fig)]
