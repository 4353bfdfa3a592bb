"""Peak memory of a training step (fp32 AdamW, torch's AdamW, bf16 + Kahan, fp16 master weights, with
and without gradient release), the first step's memory of every optimizer next to torch.optim's, and
the step time of gradient release under DDP.

Each configuration runs in a fresh subprocess (``--child NAME``, one ``RESULT {...}`` line) that
trains ``ByteGPT`` (~50M params; ``--quick``: ~12M) on random byte ids, batch 2 x sequence 64 so
activations stay small: 2 warmup steps, then 3 measured ones (median step time). Memory is
``ru_maxrss`` on CPU (children run with ``MALLOC_MMAP_THRESHOLD_=65536`` unless set, so freed
tensors go back to the OS) or ``torch.cuda.max_memory_allocated`` on CUDA, minus the child's
baseline after imports + data, before the model: the model + optimizer + gradients ("non-activation")
part. Two peaks: over all 5 steps (what a job must fit; the first step allocates the states) and over
the 3 measured steps only (the peak is reset after warmup via ``/proc/self/clear_refs``).

  fp32 AdamW                       loss.backward(); opt.step(); opt.zero_grad()
  fp32 torch.optim.AdamW           the same with torch's own AdamW (its default: a for-loop on CPU)
  bf16 + Kahan                     bf16 model; AdamW keeps bf16 states + a bf16 ``kahan_comp``
  fp16 master weights              fp16 model, fp32 masters (``MasterWeights``), ``DynamicLossScaler``
  ... + gradient release           ``prepare_for_gradient_release(model, opt)``; loss.backward() only

Claims (printed met / NOT met, never asserted): bf16 + Kahan needs >= 37% less non-activation memory
than fp32 AdamW (optimi publishes 37.5-45.5%); gradient release lowers the fp32 peak of torch's
AdamW by >= 80% of the gradients (4 B x params). fp16 master weights: memory and step-time ratios vs fp32.

First step (``--first-step``: only this; ``--no-first-step``: without it; ``--models``,
``--optimizers``, ``--code-root``): the peak rise during the first ``opt.step()`` of each of our
optimizers next to its torch.optim counterpart, in a fresh process each; what is measured and the
goal are described in ``benchmarks/memory_first_step.py``, which holds that part (the shared
measurement helpers are in ``benchmarks/memory_probe.py``).

DDP (on unless ``--quick``; ``--no-ddp``/``--ddp``): 2 gloo ranks on 127.0.0.1, ~10M fp32 params,
1 thread per rank; interleaved in the same processes after warmup, (a) DDP + ``opt.step()`` and (b)
a second DDP instance on a copy of the model with gradient release (its comm hook steps each averaged
bucket during backward). Median step time of the slowest rank, ratio (b)/(a), RSS rise during each
mode's step, grad bytes alive after backward, and the largest param difference (a) vs (b) at the end.

    python benchmarks/memory.py            # everything (several minutes on 2 cores)
    python benchmarks/memory.py --quick    # ~12M params, no DDP: a fast check
    python benchmarks/memory.py --first-step --models tensors --optimizers AdamW,Lion
Options: --threads 1 (torch threads per child), --ddp-iters 10.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from comm import _free_port, machine_facts  # noqa: E402  (benchmarks/comm.py)
from results import save  # noqa: E402
from memory_first_step import FIRST_STEP, first_step_child, report_first_step  # noqa: E402
from memory_probe import (  # noqa: E402  (benchmarks/memory_probe.py)
    BATCH, MB, MET, SEQ, SIZES, _batch, _loss, _now, _peak, _reset_peak, _result, _tensor_bytes)

import lightning_optim  # noqa: E402
from lightning_optim.model import ByteGPT  # noqa: E402
from lightning_optim.precision import DynamicLossScaler, MasterWeights  # noqa: E402

WARMUP, MEASURED = 2, 3
CONFIGS = {  # name -> (model dtype, fp32 master weights, gradient release, torch.optim.AdamW instead of ours)
    "fp32 AdamW": (torch.float32, False, False, False),
    "fp32 torch.optim.AdamW": (torch.float32, False, False, True),
    "bf16 + Kahan": (torch.bfloat16, False, False, False),
    "fp16 master weights": (torch.float16, True, False, False),
    "fp32 AdamW + gradient release": (torch.float32, False, True, False),
    "bf16 + Kahan + gradient release": (torch.bfloat16, False, True, False),
}
TORCH_ADAMW = "fp32 torch.optim.AdamW"


# ----------------------------------------------------------------------------- child: one configuration
def child(name: str, size: str, threads: int) -> None:
    torch.set_num_threads(threads)
    dtype, master, release, torch_opt = CONFIGS[name]
    cuda = torch.cuda.is_available()
    inputs, targets = _batch(0, "cuda" if cuda else "cpu")
    if cuda:
        torch.cuda.synchronize()
    _reset_peak(cuda)
    baseline, base_now = _peak(cuda), _now(cuda)
    torch.manual_seed(0)
    model = ByteGPT(max_seq_len=SEQ, **SIZES[size]).to(inputs.device, dtype)
    # weight_decay 0.01: the default of both AdamWs; torch's runs its own default (for-loop on CPU, foreach on CUDA)
    opt = (torch.optim.AdamW if torch_opt else lightning_optim.AdamW)(model.parameters(), lr=1e-4, weight_decay=0.01)
    mw = scaler = None
    if master:
        mw, scaler = MasterWeights(model.parameters()), DynamicLossScaler()
        mw.swap_into(opt)
    if release:
        lightning_optim.prepare_for_gradient_release(model, opt)
    times, stepped = [], 0
    for i in range(WARMUP + MEASURED):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = _loss(model, inputs, targets)
        if master:
            scaler.scale(loss).backward()
            stepped += mw.step(opt, scaler)
            opt.zero_grad()
            model.zero_grad()
        else:
            loss.backward()
            if not release:
                opt.step()
                opt.zero_grad()
            stepped += 1
        if cuda:
            torch.cuda.synchronize()
        if i >= WARMUP:
            times.append(time.perf_counter() - start)
        if i == WARMUP - 1:  # the peak of the warmup (first step: state allocation), then a fresh one
            warmup_peak, warm_ok = _peak(cuda), _reset_peak(cuda)
    warm_peak = _peak(cuda)
    states = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.numel() > 1]
    print("RESULT " + json.dumps({
        "device": inputs.device.type, "params": sum(p.numel() for p in model.parameters()),
        "peak_bytes": max(warmup_peak, warm_peak), "baseline_bytes": baseline,
        "non_activation_bytes": max(warmup_peak, warm_peak) - baseline,
        "warm_non_activation_bytes": warm_peak - baseline if warm_ok else None,
        "held_bytes": _now(cuda) - base_now, "param_bytes": _tensor_bytes(model.parameters()),
        "master_bytes": _tensor_bytes(m for m in mw.masters if m.dtype == torch.float32) if mw else 0,
        "state_bytes": _tensor_bytes(states), "steps_taken": stepped, "median_step_s": statistics.median(times),
        "state_keys": sorted({k for s in opt.state.values() for k, t in s.items() if torch.is_tensor(t)})}), flush=True)


def run_child(name: str, size: str, threads: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--size", size, "--threads", str(threads)]
    env = {"MALLOC_MMAP_THRESHOLD_": "65536", **os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return _result(proc.stdout, name)


# ----------------------------------------------------------------------------- DDP: step vs gradient release
def ddp_worker(rank: int, port: int, iters: int) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}",
                            timeout=timedelta(seconds=600))
    torch.manual_seed(0)
    base = ByteGPT(max_seq_len=SEQ, **SIZES["ddp"])
    plain, released = DDP(base), DDP(copy.deepcopy(base))
    opt_a = lightning_optim.AdamW(plain.parameters(), lr=1e-4)
    opt_b = lightning_optim.AdamW(released.parameters(), lr=1e-4)
    lightning_optim.prepare_for_gradient_release(released, opt_b)
    times, rise, grad_bytes = {"step": [], "release": []}, {"step": [], "release": []}, {}
    for it in range(WARMUP + iters):
        inputs, targets = _batch(1000 * it + rank)
        for mode, model, opt in (("step", plain, opt_a), ("release", released, opt_b)):
            dist.barrier()
            before, reset = _now(), _reset_peak()
            start = time.perf_counter()
            _loss(model, inputs, targets).backward()
            # (b): DDP's finalize wrote the averaged grads back after the hook stepped them
            grad_bytes[mode] = _tensor_bytes(p.grad for p in model.parameters() if p.grad is not None)
            if mode == "step":
                opt.step()
            opt.zero_grad()
            elapsed = time.perf_counter() - start  # includes counting the grads (microseconds)
            slowest = torch.tensor([elapsed], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            if it >= WARMUP:
                times[mode].append(float(slowest))
                if reset:
                    rise[mode].append(_peak() - before)
    diff = max(float((a - b).abs().max()) for a, b in zip(plain.parameters(), released.parameters()))
    if rank == 0:
        print("RESULT " + json.dumps({"params": sum(p.numel() for p in base.parameters()), "times": times,
                                      "rss_rise_bytes": rise, "grad_bytes_after_backward": grad_bytes,
                                      "max_param_diff": diff}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def run_ddp(iters: int) -> dict:
    port = _free_port()
    env = {"MALLOC_MMAP_THRESHOLD_": "65536", **os.environ, "GLOO_SOCKET_IFNAME": "lo", "PYTHONWARNINGS": "ignore"}
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--ddp-worker", "--rank", str(r),
                               "--port", str(port), "--ddp-iters", str(iters)], stdout=subprocess.PIPE, text=True,
                              env=env) for r in range(2)]
    outputs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"DDP workers failed: exit codes {[p.returncode for p in procs]}")
    return _result(outputs[0], "DDP rank 0")


# ----------------------------------------------------------------------------- parent: report
def report_memory(res: dict, size: str, threads: int) -> dict:
    ref, tref = res["fp32 AdamW"], res[TORCH_ADAMW]
    n, base = ref["params"], [r["baseline_bytes"] / MB for r in res.values()]
    what = "peak RSS" if ref["device"] == "cpu" else "max_memory_allocated"
    print(f"# peak memory of a training step ({ref['device']}): ByteGPT {SIZES[size]} = {n:,} params, batch "
          f"{BATCH} x seq {SEQ}, {WARMUP} warmup + {MEASURED} measured steps, a fresh process per configuration, "
          f"{threads} torch thread(s); baseline before the model {min(base):.0f}-{max(base):.0f} MB")
    print(f"non-act = {what} over all {WARMUP + MEASURED} steps - baseline; warm = the same over the "
          f"{MEASURED} measured steps (peak reset after warmup); held = still held after the last step; "
          f"tensors = params + fp32 masters + optimizer states; vs fp32 / vs torch = ratio to our fp32 AdamW / "
          f"to {TORCH_ADAMW}")
    print(f"{'configuration':32s} {'peak MB':>7s} {'non-act MB':>10s} {'vs fp32':>7s} {'vs torch':>8s} "
          f"{'B/param':>7s} {'warm MB':>7s} {'vs fp32':>7s} {'vs torch':>8s} {'held MB':>7s} {'tensors MB':>10s} "
          f"{'step ms':>8s} {'steps':>5s}")
    measures = {"all steps": {k: r["non_activation_bytes"] for k, r in res.items()}}
    if all(r["warm_non_activation_bytes"] is not None for r in res.values()):
        measures["after warmup"] = {k: r["warm_non_activation_bytes"] for k, r in res.items()}
    for name, r in res.items():
        non_act, tensors = r["non_activation_bytes"], r["param_bytes"] + r["master_bytes"] + r["state_bytes"]
        warm = measures.get("after warmup")
        w = (f"{warm[name] / MB:7.0f} {warm[name] / warm['fp32 AdamW']:7.3f} {warm[name] / warm[TORCH_ADAMW]:8.3f}"
             if warm else f"{'n/a':>7s} {'':7s} {'':8s}")
        print(f"{name:32s} {r['peak_bytes'] / MB:7.0f} {non_act / MB:10.0f} "
              f"{non_act / ref['non_activation_bytes']:7.3f} {non_act / tref['non_activation_bytes']:8.3f} "
              f"{non_act / n:7.2f} {w} {r['held_bytes'] / MB:7.0f} "
              f"{tensors / MB:10.0f} {r['median_step_s'] * 1e3:8.0f} {r['steps_taken']:>2d}/{WARMUP + MEASURED}")
    print(f"bf16 + Kahan optimizer states: {res['bf16 + Kahan']['state_keys']}")
    out = {"device": ref["device"], "params": n, "threads": threads, "size": SIZES[size],
           "configs": {k: {kk: v for kk, v in r.items() if kk not in ("device", "params")} for k, r in res.items()},
           "claims": {}}
    grad_size = 4 * n
    for label, m in measures.items():
        saving = 1 - m["bf16 + Kahan"] / m["fp32 AdamW"]
        rel = m[TORCH_ADAMW] - m["fp32 AdamW + gradient release"]  # against torch's AdamW
        rel_ours = m["fp32 AdamW"] - m["fp32 AdamW + gradient release"]
        brel = m["bf16 + Kahan"] - m["bf16 + Kahan + gradient release"]
        print(f"[{label}] claim bf16 + Kahan >= 37% less non-activation memory than fp32 AdamW: "
              f"{f'{saving:.1%} less' if saving >= 0 else f'{-saving:.1%} MORE'} -> {MET[saving >= 0.37]}"
              "  (optimi: 37.5-45.5%; tensors alone: 10 vs 16 B/param = 37.5%)")
        print(f"[{label}] claim gradient release lowers the fp32 peak by >= 80% of the gradients "
              f"({grad_size / MB:.0f} MB) against {TORCH_ADAMW}: {rel / MB:.0f} MB = {rel / grad_size:.1%} "
              f"({rel / m[TORCH_ADAMW]:.1%} of its non-act) -> {MET[rel >= 0.8 * grad_size]}"
              f"  (against our fp32 AdamW: {rel_ours / MB:.0f} MB = {rel_ours / m['fp32 AdamW']:.1%}; bf16 + Kahan: "
              f"release saves {brel / MB:.0f} MB = {brel / (2 * n):.1%} of its bf16 gradients)")
        out["claims"][label] = {"bf16_kahan_saving": saving, "bf16_kahan_met": saving >= 0.37,
                                "release_saving_over_grad_size": rel / grad_size, "release_met": rel >= 0.8 * grad_size,
                                "release_saving_vs_torch_adamw": rel / m[TORCH_ADAMW],
                                "release_saving_vs_our_adamw": rel_ours / m["fp32 AdamW"]}
    fp16 = res["fp16 master weights"]
    mem = {label: m["fp16 master weights"] / m["fp32 AdamW"] for label, m in measures.items()}
    slow = fp16["median_step_s"] / ref["median_step_s"]
    print(f"fp16 master weights vs fp32 AdamW: memory x{' / x'.join(f'{v:.2f}' for v in mem.values())} "
          f"({' / '.join(mem)}), step time x{slow:.2f}; {fp16['steps_taken']}/{WARMUP + MEASURED} steps taken "
          f"(the others skipped by the loss scaler)")
    out.update(fp16_master_memory_ratio=mem, fp16_master_time_ratio=slow)
    return out


def report_ddp(d: dict, iters: int) -> dict:
    a, b = statistics.median(d["times"]["step"]), statistics.median(d["times"]["release"])
    rise = {k: max(v) / MB if v else None for k, v in d["rss_rise_bytes"].items()}
    gb = {k: v / MB for k, v in d["grad_bytes_after_backward"].items()}
    print(f"# DDP, 2 gloo ranks on 127.0.0.1, 1 torch thread each, {d['params']:,} fp32 params, median of {iters} "
          f"after {WARMUP} warmup, slowest rank, the two modes interleaved in the same processes")
    print(f"(a) DDP + opt.step() after backward   : {a * 1e3:8.1f} ms")
    print(f"(b) DDP + gradient release (comm hook): {b * 1e3:8.1f} ms   ratio (b)/(a) = {b / a:.3f}")
    if rise["step"] is not None:
        print(f"rank 0 RSS rise during a step (max): (a) {rise['step']:.1f} MB, (b) {rise['release']:.1f} MB")
    print(f"grad MB alive after backward: (a) {gb['step']:.1f}, (b) {gb['release']:.1f}; "
          f"max |param (a) - param (b)| at the end = {d['max_param_diff']:.3g}")
    print("context: under DDP gradient release saves no memory (DDP's bucket buffers persist and its finalize "
          "writes the averaged grads back); its gain is overlapping the update with backward.")
    return {"params": d["params"], "step_ms": a * 1e3, "release_ms": b * 1e3, "ratio": b / a,
            "rss_rise_mb": rise, "grad_mb_after_backward": gb, "max_param_diff": d["max_param_diff"]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--ddp", dest="ddp", action="store_true", default=None)
    p.add_argument("--no-ddp", dest="ddp", action="store_false")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ddp-iters", type=int, default=10)
    p.add_argument("--first-step", dest="first_step", action="store_true", default=None,
                   help="only the first-step section")
    p.add_argument("--no-first-step", dest="first_step", action="store_false")
    p.add_argument("--models", default="gpt,tensors", help="first step: gpt (ByteGPT) and/or tensors (50 x 1M)")
    p.add_argument("--optimizers", default=",".join(FIRST_STEP), help="first step: ours, comma-separated")
    p.add_argument("--code-root", default=None,
                   help="first step: import lightning_optim from this checkout (PYTHONPATH, cwd), e.g. an older commit")
    for hidden, kw in (("--child", {}), ("--size", {"default": "full"}), ("--ddp-worker", {"action": "store_true"}),
                       ("--first-step-child", {}), ("--model", {"default": "gpt"}),
                       ("--rank", {"type": int, "default": 0}), ("--port", {"type": int, "default": 0})):  # internal
        p.add_argument(hidden, help=argparse.SUPPRESS, **kw)
    args = p.parse_args(argv)
    if args.child:
        return child(args.child, args.size, args.threads)
    if args.ddp_worker:
        return ddp_worker(args.rank, args.port, args.ddp_iters)
    if args.first_step_child:
        return first_step_child(args.first_step_child, args.model, args.size, args.threads)
    size, wall, out = "quick" if args.quick else "full", time.perf_counter(), {}
    names = [n for n in args.optimizers.split(",") if n]
    unknown = sorted(set(names) - set(FIRST_STEP)) + sorted(set(args.models.split(",")) - {"gpt", "tensors"})
    if unknown:
        p.error(f"unknown --optimizers/--models: {unknown}")
    if not args.first_step:
        out = report_memory({name: run_child(name, size, args.threads) for name in CONFIGS}, size, args.threads)
    if args.first_step is not False:
        out["first_step"] = [report_first_step(m, size, args.threads, names, args.code_root)
                             for m in args.models.split(",")]
    if not args.first_step and ((not args.quick) if args.ddp is None else args.ddp):
        out["ddp"] = report_ddp(run_ddp(args.ddp_iters), args.ddp_iters)
    out["machine"] = facts = machine_facts()
    print(f"machine: {facts['cpu']}, {facts['cores']} cores, torch {facts['torch']}, python {facts['python']}; "
          f"load average at the end: {facts['loadavg_1_5_15min']}; wall {time.perf_counter() - wall:.0f} s")
    mode = {None: "", True: "_first_step", False: "_training"}[args.first_step]
    save(f"memory{mode}", out, keep=not args.quick and not args.code_root)


if __name__ == "__main__":
    main()
