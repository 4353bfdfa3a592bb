"""Compressors side by side on the main job: bytes, step time and loss, 2 ranks on a shaped link.

Every configuration runs the main job (``lightning_optim.train.run`` on a config composed by Hydra, as
``python -m lightning_optim.train <overrides>`` would) on 2 gloo ranks with the same model, data, seed,
optimizer (AdamW) and step budget; only the strategy changes:

    fp32 DDP, torch's fp16 compression hook, PowerSGD rank 1 and 4 (torch's hook), top-k 1%, EF-sign,
    1-bit Adam, 0/1 Adam, decentralized ring

PowerSGD and the 1-bit optimizers start after the same full-precision warmup (a quarter of the steps).
Per configuration: the payload bytes per rank our collectives counted (``comm_stats()``; plain DDP's own
allreduce is not counted there: its figure is the ring rule's, marked ~), the bytes each veth end carried
(``--netns``: the kernel's tx counters, TCP/IP framing and setup included), the slower rank's median
step time, the final validation loss, and the time to reach fp32 DDP's final loss within 2% (first
validation step at or under it x median step time; "-" when never reached).

    python benchmarks/compressors.py --netns           # 2 network namespaces on a veth shaped to --rate
                                                       # (1gbit, tc tbf; root + iproute2, else a note)
    python benchmarks/compressors.py                   # loopback 127.0.0.1
Options: --steps 300 --model tiny|small --only name,name --rate 1gbit --threads 1 --out DIR (per-run outputs
and results.json). Validation every steps/10.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from comm import NETNS_ADDRS, NetnsUnavailable, _free_port, machine_facts, netns_pair  # noqa: E402
from results import save  # noqa: E402


PAPERS_OUTER = ["strategy.outer_lr=0.7", "strategy.outer_momentum=0.9", "strategy.nesterov=true"]


def configs(steps: int) -> dict[str, list[str]]:
    """Label -> the main job's strategy overrides."""
    freeze = max(1, steps // 4)
    return {
        "fp32 DDP": ["strategy=ddp", "trainer.devices=2"],
        "fp16 hook": ["strategy=fp16_compress"],
        "PowerSGD r1": ["strategy=powersgd", "strategy.matrix_approximation_rank=1",
                        f"strategy.start_powerSGD_iter={max(2, freeze)}"],
        "PowerSGD r4": ["strategy=powersgd", "strategy.matrix_approximation_rank=4",
                        f"strategy.start_powerSGD_iter={max(2, freeze)}"],
        "top-k 1%": ["strategy=topk", "strategy.ratio=0.01"],
        "EF-sign": ["strategy=sign_sgd"],
        "1-bit Adam": ["strategy=onebit_adam", f"strategy.freeze_step={freeze}"],
        "0/1 Adam": ["strategy=zero_one_adam", f"strategy.var_freeze_step={freeze}"],
        "decentralized ring": ["strategy=decentralized", "strategy.neighbors=ring", "strategy.consensus_every=0"],
        # DiLoCo: the same AdamW as the inner optimizer, the papers' outer Nesterov step (lr 0.7, momentum 0.9; the
        # tuned recipe races in lowcomm_race.py)
        "DiLoCo H=50": ["strategy=diloco", "strategy.sync_every=50", *PAPERS_OUTER],
        "DiLoCo H=100": ["strategy=diloco", "strategy.sync_every=100", *PAPERS_OUTER],
        "DiLoCo H=50 int8": ["strategy=diloco", "strategy.sync_every=50", "strategy.compressor=int8", *PAPERS_OUTER],
        "DiLoCo H=50 1-bit": ["strategy=diloco", "strategy.sync_every=50", "strategy.compressor=onebit",
                              *PAPERS_OUTER],
        "Streaming DiLoCo H=100 F=4": ["strategy=streaming_diloco", "strategy.sync_every=100", "strategy.fragments=4",
                                       *PAPERS_OUTER],
    }


def common_overrides(steps: int, model: str = "tiny", val_every: int = 0) -> list[str]:
    """What every configuration shares; validation every ``val_every`` steps (0: steps / 10)."""
    val_every = val_every or max(1, steps // 10)
    return [f"model={model}", f"trainer.max_steps={steps}", f"trainer.val_check_interval={val_every}",
            "trainer.enable_progress_bar=false", "trainer.enable_checkpointing=false", "trainer.devices=2",
            "trainer.accelerator=cpu", "trainer.log_every_n_steps=1"]


# ----------------------------------------------------------------------------- rank side
def worker(args) -> None:
    import warnings

    import torch
    from hydra import compose, initialize_config_dir

    from lightning_optim.comm import comm_stats
    from lightning_optim.conf_dir import conf_dir
    from lightning_optim.train import run

    warnings.filterwarnings("ignore")
    os.environ.update(LOCAL_RANK=str(args.rank), NODE_RANK="0", WORLD_SIZE="2", MASTER_ADDR=args.addr,
                      MASTER_PORT=str(args.port), OMP_NUM_THREADS=str(args.threads))
    torch.set_num_threads(args.threads)
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        cfg = compose("train", overrides=common_overrides(args.steps, args.model, args.val_every)
                      + json.loads(args.overrides))
    before = comm_stats().copy()
    summary = run(cfg, Path(args.run_dir))
    sent = comm_stats() - before
    result = {"median_step_s": summary["median_step_s"], "train_seconds": summary["train_seconds"],
              "step_seconds": summary["step_seconds"], "final_val_loss": summary["final_val_loss"],
              "steps": summary["steps"], "payload_bytes": sent.bytes_sent, "fp32_bytes": sent.fp32_equivalent_bytes,
              "num_params": summary["num_params"], "wall_time_s": summary["wall_time_s"]}
    Path(args.run_dir, f"rank{args.rank}.json").write_text(json.dumps(result))


# ----------------------------------------------------------------------------- parent side
def _tx_bytes(prefix, dev) -> int | None:
    if prefix is None:
        return None
    out = subprocess.run([*prefix, "cat", f"/sys/class/net/{dev}/statistics/tx_bytes"], capture_output=True, text=True)
    return int(out.stdout) if out.returncode == 0 else None


def _launch(args, label: str, overrides: list[str], addr: str, prefixes, envs, run_dir: Path, port: int) -> dict:
    run_dir.mkdir(parents=True, exist_ok=True)
    devs = [(env or {}).get("GLOO_SOCKET_IFNAME") for env in envs]
    tx_before = [_tx_bytes(p, d) for p, d in zip(prefixes, devs)]
    procs = []
    for rank in range(2):
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--rank", str(rank), "--addr", addr,
               "--port", str(port), "--steps", str(args.steps), "--threads", str(args.threads), "--model", args.model,
               "--run-dir", str(run_dir), "--overrides", json.dumps(overrides),
               "--val-every", str(getattr(args, "val_every", 0))]  # lowcomm_race.py sets it
        if prefixes[rank]:
            cmd = list(prefixes[rank]) + cmd
        procs.append(subprocess.Popen(cmd, cwd=run_dir, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                      env=dict(os.environ, **(envs[rank] or {}))))
    errors = [p.communicate()[1] for p in procs]
    if any(p.returncode for p in procs):
        tail = next(e for p, e in zip(procs, errors) if p.returncode)[-3000:]
        raise SystemExit(f"{label}: ranks failed ({[p.returncode for p in procs]}):\n{tail}")
    tx_after = [_tx_bytes(p, d) for p, d in zip(prefixes, devs)]
    wire = [a - b for a, b in zip(tx_after, tx_before)] if None not in tx_before + tx_after else None
    (run_dir / "run.json").write_text(json.dumps({"label": label, "overrides": overrides, "wire_bytes": wire}))
    return _collect(run_dir)


def _collect(run_dir: Path) -> dict:
    """One configuration's results from its folder (what ``_launch`` left there)."""
    meta = json.loads((run_dir / "run.json").read_text())
    ranks = [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(2)]
    return {**meta, "ranks": ranks, "val_curve": _val_curve(run_dir / "metrics.csv"),
            "step_bytes": _step_bytes(run_dir / "metrics.csv")}


def _val_curve(path: Path) -> list[tuple[int, float]]:
    with open(path, newline="") as f:
        return [(int(row["step"]), float(row["val_loss"])) for row in csv.DictReader(f) if row.get("val_loss")]


def _step_bytes(path: Path) -> dict[int, float]:
    """Rank 0's counted bytes per step (the strategies' telemetry; empty for plain DDP)."""
    with open(path, newline="") as f:
        return {int(row["step"]): float(row["comm/bytes_sent"]) for row in csv.DictReader(f)
                if row.get("comm/bytes_sent")}


def _cumulative(r: dict, step: int, per_step_fp32: float) -> float:
    """Bytes rank 0 sent up to metrics.csv's ``step`` (0-based: index s is the (s+1)-th step)."""
    if not r["step_bytes"]:
        return (step + 1) * per_step_fp32
    return sum(b for s, b in r["step_bytes"].items() if s <= step)


def exchange_step_costs(rows: list[dict], results: list[dict]) -> None:
    """For the methods that send only now and then: the steps that send (and, overlapped, the step after,
    which merges) against the median of the steps that send nothing, slower rank by rank."""
    print("\n| strategy | steps that send | their median / slowest ms | steps after them (merge) median / slowest ms "
          "| steps sending nothing: median ms | slowest sending step / median quiet step |")
    print("|---|---|---|---|---|---|")
    for row, r in zip(rows, results):
        sending = sorted(s for s, b in r["step_bytes"].items() if b > 0)
        if not r["step_bytes"] or len(sending) > len(r["step_bytes"]) // 4:
            continue  # plain DDP, per-step compressors: every step sends
        times = [max(rank["step_seconds"][i] for rank in r["ranks"]) for i in range(len(r["ranks"][0]["step_seconds"]))]
        # metrics.csv's steps are 0-based, as step_seconds
        send = [times[s] for s in sending if s < len(times)]
        after = [times[s + 1] for s in sending if s + 1 < len(times)]
        quiet = [t for i, t in enumerate(times) if i not in sending and i - 1 not in sending]
        median = statistics.median(quiet)
        row.update(send_step_ms=[statistics.median(send) * 1e3, max(send) * 1e3],
                   merge_step_ms=[statistics.median(after) * 1e3, max(after) * 1e3], quiet_step_ms=median * 1e3,
                   slowest_send_vs_quiet=max(send + after) / median)
        print(f"| {row['label']} | {len(send)} | {statistics.median(send) * 1e3:.0f} / {max(send) * 1e3:.0f} "
              f"| {statistics.median(after) * 1e3:.0f} / {max(after) * 1e3:.0f} | {median * 1e3:.0f} "
              f"| {max(send + after) / median:.2f}x |")


def report(args, results: list[dict], where: str) -> dict:
    facts = machine_facts()
    base = next((r for r in results if r["label"] == "fp32 DDP"), None)
    target = base["ranks"][0]["final_val_loss"] * 1.02 if base else None
    print(f"# compressors on the main job ({where}); model={args.model}, {args.steps} steps, 2 ranks, "
          f"{args.threads} thread(s) each, {results[0]['ranks'][0]['num_params'] / 1e6:.2f}M params")
    print(f"machine: {facts['cpu']}, {facts['cores']} cores, torch {facts['torch']}, python {facts['python']};"
          f" load average at the end: {facts['loadavg_1_5_15min']}")
    print("| strategy | payload MB/rank (comm_stats) | x fewer than DDP | wire MB/rank (veth) | peak MB in a step "
          "| median / mean / slowest step ms | final val loss | vs fp32 DDP | time to fp32 loss +2% |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    per_step_fp32 = 4 * results[0]["ranks"][0]["num_params"]  # the ring all-reduce on 2 ranks: 2 (W-1)/W x 4 B
    ddp_payload = results[0]["ranks"][0]["steps"] * per_step_fp32 / 1e6
    for r in results:
        step_s = max(rank["median_step_s"] for rank in r["ranks"])
        mean_s = max(rank["train_seconds"] / max(rank["steps"], 1) for rank in r["ranks"])
        slowest_s = max(max(rank["step_seconds"]) for rank in r["ranks"])
        payload = max(rank["payload_bytes"] for rank in r["ranks"]) / 1e6
        nominal = r["label"] == "fp32 DDP"  # Lightning's own DDP allreduce: the ring rule, not a counter
        if nominal:
            payload = ddp_payload
        peak = max(r["step_bytes"].values()) / 1e6 if r["step_bytes"] else per_step_fp32 / 1e6
        wire = max(r["wire_bytes"]) / 1e6 if r["wire_bytes"] else None
        loss = r["ranks"][0]["final_val_loss"]
        reached = next((step for step, v in r["val_curve"] if target is not None and v <= target), None)
        # metrics.csv's steps are 0-based; the exchanges' cost spread over the steps
        to_loss = None if reached is None else (reached + 1) * mean_s
        rel = (loss / base["ranks"][0]["final_val_loss"] - 1) * 100 if base else None
        rows.append({"label": r["label"], "payload_mb": payload, "fewer_x": ddp_payload / payload if payload else None,
                     "wire_mb": wire, "peak_step_mb": peak, "median_step_ms": step_s * 1e3,
                     "mean_step_ms": mean_s * 1e3, "slowest_step_ms": slowest_s * 1e3, "final_val_loss": loss,
                     "vs_fp32_pct": rel, "time_to_loss_s": to_loss, "reached_step": reached,
                     "overrides": r["overrides"], "val_curve": r["val_curve"],
                     "sent_mb_curve": [_cumulative(r, step, per_step_fp32) / 1e6 for step, _ in r["val_curve"]]})
        wire_text = "-" if wire is None else f"{wire:.1f}"
        fewer = "-" if not payload else f"{ddp_payload / payload:.0f}x"
        print(f"| {r['label']} | {'~' if nominal else ''}{payload:.2f} | {fewer} | {wire_text} | {peak:.2f} "
              f"| {step_s * 1e3:.0f} / {mean_s * 1e3:.0f} / {slowest_s * 1e3:.0f} "
              f"| {loss:.4f} | {'-' if rel is None else f'{rel:+.2f}%'} | "
              f"{'-' if to_loss is None else f'{to_loss:.1f} s (step {reached + 1})'} |")
    exchange_step_costs(rows, results)
    out = {"where": where, "steps": args.steps, "model": args.model, "machine": facts, "rows": rows,
           "num_params": results[0]["ranks"][0]["num_params"]}
    save(f"compressors_{args.model}_{args.rate if args.netns else 'loopback'}", out)
    return out


def only(parser: argparse.ArgumentParser, chosen: dict[str, list[str]], names: str) -> dict[str, list[str]]:
    """The configurations ``--only`` names (comma-separated labels; all when empty), or a parser error."""
    if not names:
        return chosen
    wanted = [name.strip() for name in names.split(",")]
    unknown = [w for w in wanted if w not in chosen]
    if unknown:
        parser.error(f"--only: unknown {unknown}; choose from {list(chosen)}")
    return {k: v for k, v in chosen.items() if k in wanted}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--model", default="tiny", help="the main job's model option (tiny: 0.84M params, small: 4.8M)")
    p.add_argument("--only", default="", help="comma-separated labels (default: all)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--netns", action="store_true")
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--out", default="")
    p.add_argument("--report-from", default="", help="print the report again from an earlier --out folder "
                   "(its configurations in --only order, else all found); with --where saying where it ran")
    p.add_argument("--where", default="")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--addr", default="127.0.0.1", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--run-dir", default="", help=argparse.SUPPRESS)
    p.add_argument("--overrides", default="[]", help=argparse.SUPPRESS)
    p.add_argument("--val-every", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return
    chosen = only(p, configs(args.steps), args.only)
    if args.report_from:
        folder = Path(args.report_from)
        found = {json.loads(f.read_text())["label"]: f.parent for f in folder.glob("*/run.json")}
        labels = [label for label in chosen if label in found] if args.only else sorted(found)
        args.out = args.out or str(folder)
        report(args, [_collect(found[label]) for label in labels], args.where or "as recorded")
        return
    out_dir = Path(args.out or tempfile.mkdtemp(prefix="compressors_"))

    def run_all(addr, prefixes, envs, where):
        results = []
        for i, (label, overrides) in enumerate(chosen.items()):
            start = time.perf_counter()
            port = _free_port() if prefixes[0] is None else 29521 + i  # a fresh port per run (no TIME_WAIT clash)
            results.append(_launch(args, label, overrides, addr, prefixes, envs,
                                   out_dir / label.replace(" ", "_").replace("%", "pct").replace("/", "_"), port))
            print(f"# {label}: {time.perf_counter() - start:.0f} s", flush=True)
        (out_dir / "results.json").write_text(json.dumps(report(args, results, where), indent=1))

    if not args.netns:
        run_all("127.0.0.1", (None, None), ({"GLOO_SOCKET_IFNAME": "lo"},) * 2, "loopback 127.0.0.1")
        return
    try:
        with netns_pair(args.rate) as (prefixes, envs):
            run_all(NETNS_ADDRS[0], prefixes, envs, f"2 network namespaces, veth shaped to {args.rate} (tc tbf)")
    except NetnsUnavailable as exc:
        print(f"--netns {exc}: skipped")


if __name__ == "__main__":
    main()
