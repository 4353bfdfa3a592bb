"""Results page sections measured on one machine: optimizer steps, kernels, memory, the GPU check."""

from __future__ import annotations

from results_format import MB, f, pct, reading, span, table, x


def optimizers_body(rec: dict) -> list[str]:
    d = rec["data"]
    rows = [[r["optimizer"], r["path"], f(r["ours_ms"]), r["torch_path"] if r["torch_ms"] else None,
             f(r["torch_ms"]), x(r["ours_ms"] / r["torch_ms"]) if r["torch_ms"] else None] for r in d["rows"]]
    foreach = [r["ours_ms"] / r["torch_ms"] for r in d["rows"] if r["torch_ms"] and r["torch_path"] == "foreach"]
    fused = [r["ours_ms"] / r["torch_ms"] for r in d["rows"] if r["torch_ms"] and r["torch_path"] == "fused"]
    return [f"{d['params']:,} {d['dtype']} params in {d['tensors']} tensors (sizes spread over two orders of "
            "magnitude), random gradients. Each optimizer's for-loop (`foreach=False`) and multi-tensor "
            "(`foreach=True`) path runs next to torch's equivalent with the same arguments, on copies of the same "
            f"parameters, timed round-robin in one process; median of {d['steps']} steps. Ours runs the compiled "
            "CPU kernels where the optimizer has one, torch's foreach math otherwise.", "",
            *table(["optimizer", "path", "ours, ms", "torch path", "torch, ms", "ours / torch"], rows, "llrlrr"),
            *reading(f"Below 1x is faster than torch. Where torch has the optimizer, our multi-tensor step takes "
                     f"{span(foreach, x)} of torch's foreach step and {span(fused, x)} of torch's fused Adam/AdamW; "
                     "the for-loop paths exist for compatibility, the default (`foreach=None`) is the multi-tensor "
                     "one.")]


def kernels_body(rec: dict) -> list[str]:
    d = rec["data"]
    rows = []
    for case in d["cases"]:
        size = (f"{case['params'] / 1e6:.0f}M params in {case['tensors']} tensors" if "params" in case
                else f"{case['values'] / 1e6:.0f}M values")
        for i, r in enumerate(case["rows"]):
            rows.append([f"{case['case']}, {size}" if i == 0 else "", r["contender"], f(r["ms"]),
                         "ref" if r["ratio"] is None else x(r["ratio"]), f(r["GBps"], 1), pct(r["roof_pct"], 0)])
    big = _case(d, "AdamW fp32, 8 big tensors")
    small = _case(d, "AdamW fp32, many small tensors")
    return [f"One process, {d['machine'].split('torch threads ')[1].split(',')[0]} threads; the contenders of a case "
            f"are timed round-robin (median of {d['rounds']} rounds after 2 warm-up calls). The roof is an in-place "
            "pass reading 4 and writing 3 fp32 arrays (the traffic of an fp32 AdamW step) on the kernels' own "
            "driver, measured before each case; bandwidth counts the bytes an update must move (fp32 AdamW 28 B per "
            "param; bf16 params + fp32 state + Kahan with bf16 grads 26 B; 1-bit compress with the norm scale "
            "20.1 B per value in two passes, with a given scale 12.1 B; unpack 4.1 B). Ratios are to the first "
            f"row of the case (or the row marked ref). CPU: {d['machine'].split(';')[0]}.", "",
            *table(["case", "contender", "ms", "ratio", "GB/s", "of roof"], rows, "llrrrr"),
            *reading(f"On 8 big tensors our AdamW step runs at {pct(_row(big, 'cpu kernels')['roof_pct'], 0)} of the "
                     f"roof, {x(_row(big, 'cpu kernels')['ratio'])} torch's fused step; on 2000 small tensors it "
                     f"takes {x(_row(small, 'cpu kernels')['ratio'])} of torch's fused time, "
                     f"{x(_row(small, 'flat params')['ratio'])} with `flatten_parameters` (params and grads in one "
                     "buffer each), where per-tensor work, not bandwidth, bounds the step.")]


def _case(d: dict, title: str) -> dict:
    return next(c for c in d["cases"] if c["case"] == title)


def _row(case: dict, contains: str) -> dict:
    return next(r for r in case["rows"] if r["contender"].endswith(contains))


def cuda_body(rec: dict) -> list[str]:
    d = rec["data"]
    rows, last = [], None
    for r in d["rows"]:
        rows.append(["" if r["case"] == last else r["case"], r["contender"], f(r["ms"], 3),
                     "ref" if r["ratio"] == 1.0 else x(r["ratio"]), pct(r["roof_pct"], 0)])
        last = r["case"]
    suites = d.get("suites", {})
    big = next(r for r in d["rows"] if r["case"] == "AdamW, 8 big tensors" and r["contender"].endswith("cuda kernels"))
    return [f"One {d['device']} ({d['sms']} SMs), torch {d['torch']}, CUDA {d['cuda']}; roof: a device-to-device "
            f"copy of 2 GB, {d['roof_gbps']:,} GB/s (bytes read + written). Medians of {d['rounds']} rounds over CUDA "
            "events, contenders round-robin; ratio to torch's fused AdamW (AdamW cases) or to torch ops (1-bit).", "",
            *table(["case", "contender", "ms", "ratio", "of roof"], rows, "llrrr"),
            *(["The same run's test suites on the GPU: " + "; ".join(
                f"`{name}` {s['passed']} passed, {s['failed']} failed, {s['skipped']} skipped"
                for name, s in suites.items()) + ". " + d.get("suites_note", ""), ""] if suites else []),
            *reading(f"On big tensors our AdamW step is {x(big['ratio'])} torch's fused step at "
                     f"{pct(big['roof_pct'], 0)} of the copy roof; the 1-bit passes run near the roof.")]


MEMORY_REF, MEMORY_TORCH = "fp32 AdamW", "fp32 torch.optim.AdamW"


def memory_body(rec: dict) -> list[str]:
    d = rec["data"]
    configs = d["configs"]
    ours, theirs = configs[MEMORY_REF]["non_activation_bytes"], configs[MEMORY_TORCH]["non_activation_bytes"]
    rows = [[name, f(c["non_activation_bytes"] / MB, 0), x(c["non_activation_bytes"] / ours),
             x(c["non_activation_bytes"] / theirs), f(c["warm_non_activation_bytes"] / MB, 0), f(c["held_bytes"] / MB, 0),
             f(c["median_step_s"] * 1e3, 0)] for name, c in configs.items()]
    claims = d["claims"]["all steps"]
    lines = [f"ByteGPT ({', '.join(f'{k} {v}' for k, v in d['size'].items())}) = {d['params']:,} params, a fresh process "
             f"per configuration, {d['threads']} torch thread(s), 2 warm-up + 3 measured steps on {d['device']}. "
             "non-act = peak RSS over all steps minus the process's RSS before the model existed; warm = the same "
             "over the measured steps only; held = RSS held after the last step.", "",
             *table(["configuration", "non-act MB", "vs our fp32 AdamW", "vs torch's AdamW", "warm MB", "held MB",
                     "step ms"], rows, "lrrrrrr"),
             *reading(f"Gradient release saves {pct(100 * claims['release_saving_over_grad_size'], 1)} of the "
                      "gradients' size against torch's AdamW (each gradient is consumed as backward makes it); bf16 "
                      f"params and states with Kahan summation need {pct(100 * claims['bf16_kahan_saving'], 1)} less "
                      "than our fp32 AdamW (37.5% is the tensors' own ceiling: 10 against 16 bytes per param). On a CPU "
                      "without fp16 arithmetic the fp16 step time says nothing about a GPU's.")]
    for first in d.get("first_step", []):
        lines += first_step_table(first)
    if "ddp" in d:
        r = d["ddp"]
        lines += [f"Gradient release under DDP: 2 gloo ranks on loopback, {r['params']:,} fp32 params, the two modes "
                  f"interleaved in the same processes: a step takes {f(r['step_ms'], 1)} ms with `opt.step()` after "
                  f"backward and {f(r['release_ms'], 1)} ms with the release hook ({x(r['ratio'], 3)}).", ""]
    return lines


def first_step_table(first: dict) -> list[str]:
    shape = (f"ByteGPT ({', '.join(f'{k} {v}' for k, v in first['size'].items())})" if first["model"] == "gpt"
             else f"{first['size']['tensors']} plain Parameters of {first['size']['numel']:,} elements")
    rows = []
    for name, r in first["rows"].items():
        o, t = r["ours"], first["torch"][r["torch"].rstrip("*")]
        rows.append([name, f(o["state_bytes"] / MB, 1), f(o["rise_bytes"] / MB, 1),
                     f((o["rise_bytes"] - o["state_bytes"]) / MB, 1), r["torch"], f(t["rise_bytes"] / MB, 1),
                     f((t["rise_bytes"] - t["state_bytes"]) / MB, 1), pct(100 * r["diff_over_state"], 1, sign=True)])
    worst = max(r["diff_over_state"] for r in first["rows"].values())
    return [f"The first `step()` on {shape}, a fresh process per optimizer: rise = peak RSS during the step (reset "
            "right before it) minus what was held before the optimizer was built; extra = rise minus the optimizer's "
            "own state; diff = (extra - torch's extra) / own state. An optimizer without a torch.optim counterpart "
            "(marked \\*) is held to torch's AdamW by what each needs beyond its states.", "",
            *table(["optimizer", "state MB", "rise MB", "extra MB", "torch.optim", "its rise MB", "its extra MB",
                    "diff"], rows, "lrrrlrrr"),
            *reading(f"Every optimizer's first step needs at most {pct(100 * worst, 1, sign=True)} of its state beyond "
                     "what torch's needs beyond its own: the states are made in place, with no second copy.")]
