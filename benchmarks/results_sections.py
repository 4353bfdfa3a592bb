"""The results page's sections: per claim, the method in words and a table (or plot) read from the saved files.

Each section names the files it reads (``benchmarks/results/<name>.json``, written by ``results.save``); its
text holds no measured number of its own: every figure is formatted from those files.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from results_format import MB, run_facts
from results_ft import fault_tolerance_body
from results_nodes import compressors_body, diloco_body, diloco_plot, hierarchy_body, hsdp_body
from results_onebit import (
    auto_freeze_body,
    comm_body,
    compile_breaks_body,
    convergence_body,
    convergence_plot,
    onebit_compute_body,
    onebit_step_body,
    overlap_body,
    precision_body,
    precision_plot,
)
from results_race import race_body, race_plot
from results_sweep import sweep_body
from results_single import cuda_body, kernels_body, memory_body, optimizers_body

INTRO = """# Results

What the library's claims rest on, one section per claim. Each section says what ran where (machine,
versions, date, load), the exact command, and shows the figures that command saved: every number below is
read from `benchmarks/results/<name>.json` by `python benchmarks/results_page.py`, which writes this page and
its plots. Re-running a benchmark and then that script updates its section.

Times depend on the machine and on what else it runs, so every timed comparison is made side by side in one
run (contenders interleaved) and read as a ratio; bytes and losses are exact and repeat from run to run.
MB is 10^6 bytes throughout.
"""


@dataclass
class Section:
    title: str
    files: tuple[str, ...]
    claim: str
    body: Callable[..., list[str]]
    plot: Callable[..., list] | None = None

    def render(self, results: dict[str, dict]) -> str:
        lines = [f"## {self.title}", "", self.claim, ""]
        missing = [name for name in self.files if name not in results]
        if missing:
            lines += ["Not measured yet: " + ", ".join(f"`benchmarks/results/{m}.json`" for m in missing)
                      + " is missing.", ""]
            return "\n".join(lines)
        records = [results[name] for name in self.files]
        for record in records:
            lines += run_facts(record)
        lines += self.body(*records)
        return "\n".join(lines) + "\n"

    def plots(self, results: dict[str, dict], plt) -> list:
        if self.plot is None or any(name not in results for name in self.files):
            return []
        return self.plot(plt, *[results[name] for name in self.files])


SECTIONS: list[Section] = [
    Section("Optimizer step time on CPU", ("optimizers",),
            "Every optimizer's step next to torch.optim's on the same parameters: `python benchmarks/optimizers.py`.",
            optimizers_body),
    Section("CPU kernels against the memory roof", ("kernels",),
            "The compiled CPU kernels against torch's fused AdamW and the machine's memory bandwidth: "
            "`python benchmarks/kernels.py`.", kernels_body),
    Section("Memory", ("memory",),
            "Peak memory of a training step for each precision option and gradient release, and of the first "
            "optimizer step next to torch.optim's: `python benchmarks/memory.py`.", memory_body),
    Section("1-bit allreduce: bytes and time", ("comm_netns",),
            "What `compressed_allreduce` sends and saves on a 1 Gbit/s link: `python benchmarks/comm.py --netns`.",
            comm_body),
    Section("1-bit Adam: step time in training", ("onebit_step_netns_1x16", "onebit_step_netns_4x64"),
            "OnebitAdam's training step against DDP + AdamW on a 1 Gbit/s link: "
            "`python benchmarks/onebit_step.py --netns`.", onebit_step_body),
    Section("1-bit Adam: the step's compute", ("onebit_compute",),
            "The 1-bit stage's step against AdamW's with the communication taken off: "
            "`python benchmarks/onebit_compute.py`.", onebit_compute_body),
    Section("1-bit Adam: overlap with backward", ("onebit_step_netns_4x64_overlap",),
            "The exchange overlapped with backward against the plain 1-bit stage and no communication at all: "
            "`python benchmarks/onebit_step.py --netns --overlap`.", overlap_body),
    Section("Convergence of the 1-bit optimizers", ("convergence",),
            "Final validation loss of each 1-bit optimizer against its full-precision counterpart at equal steps: "
            "`python benchmarks/convergence.py`.", convergence_body, convergence_plot),
    Section("Precision options against fp32", ("precision_convergence",),
            "Final validation loss of the 16-bit options against fp32 on the main job: "
            "`python benchmarks/precision_convergence.py`.", precision_body, precision_plot),
    Section("1-bit Adam on HSDP", ("hsdp",),
            "Inter-node bytes, step time and optimizer state of OnebitAdam on a sharded (HSDP) model across two "
            "nodes: `python benchmarks/hsdp.py`.", hsdp_body),
    Section("Hierarchical 1-bit across nodes", ("hierarchy",),
            "The hierarchical 1-bit exchange against the flat one across two nodes: `python benchmarks/hierarchy.py`.",
            hierarchy_body),
    Section("Compressors on the main job", ("compressors_tiny_1gbit",),
            "Every gradient compressor and communication-efficient strategy on the same training job: bytes, step "
            "time and loss: `python benchmarks/compressors.py --netns`.", compressors_body),
    Section("DiLoCo against DDP and 1-bit Adam", ("compressors_small_100mbit",),
            "DiLoCo and Streaming DiLoCo against DDP and 1-bit Adam on a slow link: bytes, time and loss at equal "
            "tokens: `python benchmarks/compressors.py --netns --rate 100mbit --model small`.", diloco_body,
            diloco_plot),
    Section("DiLoCo recipe sweep", ("diloco_sweep_tiny", "diloco_sweep_tiny_1000", "diloco_sweep_small"),
            "DiLoCo's outer learning rate and momentum, `sync_every`, the inner learning rate and warmup, and the "
            "compressors, each against DDP at equal tokens on the main job: `python benchmarks/diloco_sweep.py`.",
            sweep_body),
    Section("Low-communication race", ("lowcomm_race",),
            "DDP, 1-bit Adam, DiLoCo, Streaming DiLoCo with int4 outer gradients and SparseLoCo on the same job over "
            "a slow and a fast link: validation loss against training time and bytes, and the time each takes to "
            "reach DDP's final loss: `python benchmarks/lowcomm_race.py`.", race_body, race_plot),
    Section("Fault-tolerant DiLoCo: goodput with replicas killed", ("fault_tolerance",),
            "Replicas killed and relaunched every T seconds under torchft against a failure-free run and a job that "
            "restarts from its checkpoints: goodput, the cost of a kill, final loss: "
            "`python benchmarks/fault_tolerance.py`.", fault_tolerance_body),
    Section("freeze_step=\"auto\"", ("auto_freeze",),
            "The automatic switch to the 1-bit stage against fixed switch steps: `python benchmarks/auto_freeze.py`.",
            auto_freeze_body),
    Section("torch.compile graph breaks", ("compile_breaks",),
            "What `torch.compile` sees of a training step with our optimizers: "
            "`python benchmarks/compile_breaks.py --eager-step`.", compile_breaks_body),
    Section("CUDA kernels against the HBM roof", ("kernels_cuda",),
            "The CUDA kernels against torch's fused AdamW and the GPU's memory bandwidth: "
            "`bash benchmarks/gpu_check.sh \"$OUT\"` (its kernels step runs `python benchmarks/kernels_cuda.py`).",
            cuda_body),
]


# ----------------------------------------------------------------------------- the README's headline results
def _anchor(title: str) -> str:
    """The heading's anchor as MkDocs (and GitHub) spell it."""
    kept = "".join(ch for ch in title.lower() if ch.isalnum() or ch in " -_")
    return "docs/benchmarks.md#" + re.sub(r"[-\s]+", "-", kept.strip())


def _section(files: tuple[str, ...]) -> str:
    section = next(s for s in SECTIONS if s.files == files)
    return f"[{section.title}]({_anchor(section.title)})"


def _allreduce(r: dict) -> str:
    d = r["comm_netns"]["data"]
    return (f"**1-bit all-reduce: {d['bytes_ratio']:.0f}x fewer bytes** than fp32 ({d['onebit_bytes_per_rank'] / MB:.2f} "
            f"instead of {d['fp32_bytes_per_rank'] / MB:.0f} MB per rank for {d['numel'] / 1e6:.0f}M values), "
            f"{d['time_ratio']:.1f}x faster on a 1 Gbit/s link. {_section(('comm_netns',))}")


def _slow_link(r: dict) -> str:
    d = r["compressors_small_100mbit"]["data"]
    by = {row["label"]: row for row in d["rows"]}
    ddp, onebit, diloco = by["fp32 DDP"], by["1-bit Adam"], by["DiLoCo H=100"]
    reached = (f"reached fp32 DDP's final loss + 2% in {onebit['time_to_loss_s']:.0f} s instead of "
               f"{ddp['time_to_loss_s']:.0f} s" if onebit["time_to_loss_s"] else
               f"ended {onebit['vs_fp32_pct']:+.1f}% from fp32 DDP's loss")
    return (f"**1-bit Adam at 100 Mbit/s** {reached} ({onebit['payload_mb']:.0f} instead of {ddp['payload_mb']:.0f} MB "
            f"sent per rank); DiLoCo (`sync_every=100`) sent {diloco['fewer_x']:.0f}x fewer bytes than DDP, ending "
            f"{diloco['vs_fp32_pct']:+.0f}% from DDP's loss after {d['steps']} steps. "
            f"{_section(('compressors_small_100mbit',))}")


def _race(r: dict) -> str:
    from results_race import ddp_loss_at

    d = r["lowcomm_race"]["data"]
    rate = next(iter(d["rates"]))
    rows = {row["label"]: row for row in d["rates"][rate]["rows"]}
    ddp, frugal = rows["DDP"], min((row for row in rows.values() if (row["fewer_x"] or 0) >= 100),
                                   key=lambda row: row["vs_ddp_pct"])
    at = ddp_loss_at(ddp, frugal["train_s"][-1])
    same_time = "" if at is None else f"{(frugal['final_val_loss'] / at - 1) * 100:+.1f}% against DDP's loss after the " \
                                      "same training time, "
    return (f"**{frugal['label']} at {rate}**: {frugal['fewer_x']:.0f}x fewer bytes than DDP, {same_time}"
            f"{frugal['vs_ddp_pct']:+.1f}% at equal tokens ({d['steps']} steps of the `{d['model']}` model). "
            f"{_section(('lowcomm_race',))}")


def _gpu(r: dict) -> str:
    rows = r["kernels_cuda"]["data"]["rows"]
    ours = {row["case"]: row["ratio"] for row in rows if row["contender"].endswith("cuda kernels")}
    return (f"**AdamW on an {r['kernels_cuda']['data']['device'].split(' ')[1]}**: "
            f"{ours['AdamW, GPT-2-small-like layout']:.2f}x the time of torch's fused AdamW on the GPT-2-small layout, "
            f"{ours['AdamW, many small tensors']:.2f}x on 10M parameters in 2000 tensors, "
            f"{ours['AdamW, 8 big tensors']:.2f}x on 200M in 8 tensors. {_section(('kernels_cuda',))}")


def _converges(r: dict) -> str:
    runs = r["convergence"]["data"]["runs"]
    one, base = runs["OnebitAdam"]["summary"], runs["AdamW + DDP"]["summary"]
    return (f"**1-bit Adam converges**: the main job's final validation loss {one['final_val_loss']:.3f} against "
            f"{base['final_val_loss']:.3f} for AdamW + DDP at equal steps, with "
            f"{one['comm']['fp32_bytes'] / one['comm']['bytes_sent']:.1f}x fewer bytes. {_section(('convergence',))}")


HEADLINES: list[tuple[tuple[str, ...], Callable[[dict], str]]] = [
    (("comm_netns",), _allreduce), (("compressors_small_100mbit",), _slow_link), (("lowcomm_race",), _race),
    (("kernels_cuda",), _gpu),
    (("convergence",), _converges)]


def headlines(results: dict[str, dict]) -> list[str]:
    """The README's results list: one line per headline whose files exist."""
    return [f"- {line(results)}" for files, line in HEADLINES if all(name in results for name in files)]
