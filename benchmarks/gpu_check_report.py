"""gpu_check.sh's report: one JSON and one Markdown table from what the steps left in the work folder.

    python benchmarks/gpu_check_report.py WORK OUT

Reads WORK/steps.tsv (name, exit status, seconds, note: one line per step, written by gpu_check.sh),
WORK/junit_*.xml (pytest), WORK/kernels.json (kernels_cuda.py --json), WORK/ranks_{cpu,cuda}.rank*.pt
(gpu_check_ranks.py); writes OUT/gpu_check.json and OUT/gpu_check.md. A missing piece is reported as
missing (dry run, or a step that failed), never as a pass.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

# 2 ranks, CUDA vs CPU tensors: the kernels' documented fp32 tolerance (tests/ops/test_optim_kernels.py:
# states rtol 1e-5, atol 1e-6); the GPU's fused multiply-adds and sum orders move the 1-bit scales by
# ulps, which can flip the sign of a value within an ulp of 0: at most this fraction may differ more.
RTOL, ATOL, MAX_OFF_FRACTION = 1e-5, 1e-6, 1e-4
# The compressed allreduce's outputs and error buffers are x - scale * sign(x) per segment, with one fp32
# sum of squares behind each scale (CPU: fp32 lanes added in double; GPU: a tree): the sums differ by ~1e-6
# relative, which moves every element of a segment by that much of the scale, small elements included
# (first H100 run: max 8e-6 absolute, 1.4% of elements beyond the element-wise tolerance). So those parts
# are held to RTOL of their largest magnitude; a wrong bit, piece or scale still differs by O(scale).


def read_steps(work: Path) -> list[dict]:
    path = work / "steps.tsv"
    if not path.exists():
        return []
    steps = []
    for line in path.read_text().splitlines():
        name, rc, seconds, note = (line.split("\t") + ["", "", ""])[:4]
        steps.append(dict(step=name, rc=int(rc) if rc.lstrip("-").isdigit() else None,
                          seconds=float(seconds or 0), note=note))
    return steps


def read_junit(work: Path) -> dict:
    """Counts per file of junit XML, with each failure's test id and first line."""
    suites = {}
    for path in sorted(work.glob("junit_*.xml")):
        counts = dict(passed=0, failed=0, skipped=0, errors=0)
        failures = []
        try:
            root = ET.parse(path).getroot()
        except ET.ParseError as exc:  # a pytest killed by its timeout leaves a partial file
            suites[path.stem[6:]] = dict(counts, failures=[f"junit unreadable: {exc}"])
            continue
        for case in root.iter("testcase"):
            test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            if bad is not None:
                counts["failed" if bad.tag == "failure" else "errors"] += 1
                first = (bad.get("message") or bad.text or "").strip().splitlines()
                failures.append(f"{test_id}: {first[0][:200] if first else ''}")
            elif case.find("skipped") is not None:
                counts["skipped"] += 1
            else:
                counts["passed"] += 1
        suites[path.stem[6:]] = dict(counts, failures=failures)
    return suites


def _flat(tensors) -> "torch.Tensor":
    import torch

    return torch.cat([t.reshape(-1).double() for t in tensors]) if tensors else torch.zeros(0, dtype=torch.float64)


def _diff(a, b, scale_relative: bool = False) -> dict:
    a, b = _flat(a), _flat(b)
    if a.shape != b.shape:
        return dict(ok=False, note=f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    tol = ATOL + RTOL * (b.abs().nan_to_num(0.0).max() if scale_relative and b.numel() else b.abs())
    off = ((a - b).abs() > tol) & ~(a.isnan() & b.isnan())
    frac = off.double().mean().item() if a.numel() else 0.0
    return dict(ok=frac <= MAX_OFF_FRACTION, elements=a.numel(), bitwise=bool(a.equal(b)),
                max_abs=(a - b).abs().nan_to_num(0.0).max().item() if a.numel() else 0.0, off_fraction=frac)


def compare_ranks(work: Path) -> dict:
    import torch

    runs = {}
    for device in ("cpu", "cuda"):
        files = sorted(work.glob(f"ranks_{device}.rank*.pt"))
        runs[device] = [torch.load(f, weights_only=False) for f in files]
    out = dict(cpu_ranks=len(runs["cpu"]), cuda_ranks=len(runs["cuda"]), parts={})
    for device, ranks in runs.items():
        for r, res in enumerate(ranks):
            for part, err in res.get("errors", {}).items():
                out["parts"][f"{part} ({device}, rank {r})"] = dict(ok=False, note=err)
    if not runs["cpu"] or not runs["cuda"]:
        out["note"] = "needs both runs (cpu and cuda)"
        return out
    for r, (c, g) in enumerate(zip(runs["cpu"], runs["cuda"])):
        if "allreduce" in c and "allreduce" in g:
            out["parts"][f"compressed allreduce, rank {r}"] = _diff(g["allreduce"], c["allreduce"], scale_relative=True)
        if "train" in c and "train" in g:
            steps = [_diff(gs, cs) for gs, cs in zip(g["train"]["history"], c["train"]["history"])]
            worst = max(steps, key=lambda d: d.get("off_fraction", 1.0)) if steps else dict(ok=False)
            out["parts"][f"OnebitAdam {len(steps)} steps, rank {r}"] = dict(
                worst, ok=all(d["ok"] for d in steps), first_not_bitwise=next(
                    (i + 1 for i, d in enumerate(steps) if not d.get("bitwise")), None))
    return out


def markdown(report: dict) -> str:
    lines = ["# gpu_check", "", f"{report['mode']}; {report.get('device', 'no GPU')}", "", "## Steps", "",
             "| step | exit | seconds | note |", "|---|---|---|---|"]
    lines += [f"| {s['step']} | {s['rc']} | {s['seconds']:.0f} | {s['note']} |" for s in report["steps"]]
    lines += ["", "## Tests", "", "| suite | passed | failed | errors | skipped |", "|---|---|---|---|---|"]
    fails = []
    for name, s in report["tests"].items():
        lines.append(f"| {name} | {s['passed']} | {s['failed']} | {s['errors']} | {s['skipped']} |")
        fails += s["failures"]
    if fails:
        lines += ["", "Failures (first line):", ""] + [f"* `{f}`" for f in fails[:60]]
    k = report.get("kernels")
    lines += ["", "## Kernels", ""]
    if k:
        lines += [f"Roof (device-to-device copy, read + written): {k['roof_gbps']:.0f} GB/s on {k['device']}", "",
                  "| case | contender | ms | ratio | GB/s | % roof |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['case']} | {r['contender']} | {r['ms']:.3f} | {r['ratio']:.2f}x | {r['gbps']:.0f} | "
                  f"{r['roof_pct']:.0f}% |" for r in k["rows"]]
    else:
        lines.append("not run")
    ranks = report["ranks"]
    lines += ["", "## 2 ranks over gloo: CUDA tensors vs CPU tensors", "",
              f"tolerance: rtol {RTOL}, atol {ATOL}, at most {MAX_OFF_FRACTION:g} of the values beyond it; "
              "the compressed allreduce: rtol of its largest magnitude (one sum of squares per scale)", "",
              "| part | ok | bitwise | max abs diff | beyond tolerance | note |", "|---|---|---|---|---|---|"]
    for name, d in ranks.get("parts", {}).items():
        lines.append(f"| {name} | {d.get('ok')} | {d.get('bitwise', '')} | {d.get('max_abs', '')} | "
                     f"{d.get('off_fraction', '')} | {d.get('note', '')} |")
    if ranks.get("note"):
        lines += ["", ranks["note"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    work, out = Path(sys.argv[1]), Path(sys.argv[2])
    meta = json.loads((work / "meta.json").read_text()) if (work / "meta.json").exists() else {}
    kernels = json.loads((work / "kernels.json").read_text()) if (work / "kernels.json").exists() else None
    report = dict(meta, mode=meta.get("mode", "?"), steps=read_steps(work), tests=read_junit(work), kernels=kernels,
                  ranks=compare_ranks(work))
    report["ok"] = (all(s["rc"] == 0 for s in report["steps"] if s["rc"] is not None)
                    and all(t["failed"] == 0 and t["errors"] == 0 for t in report["tests"].values())
                    and all(d.get("ok") for d in report["ranks"].get("parts", {}).values()))
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "gpu_check.md").write_text(markdown(report))
    print(markdown(report))
    print(f"gpu_check: {'OK' if report['ok'] else 'NOT OK'} ({out / 'gpu_check.json'}, {out / 'gpu_check.md'})")


if __name__ == "__main__":
    main()
