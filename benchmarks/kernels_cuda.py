"""CUDA kernels vs torch on one GPU, side by side in one process.

    python benchmarks/kernels_cuda.py            # needs a CUDA GPU and the extension built with CUDA
    python benchmarks/kernels_cuda.py --json k.json   # also every row as JSON (gpu_check.sh's report reads it)

Prints the GPU, its memory roof (torch's device-to-device copy of a 2 GB buffer: bytes read + written
per second), then per case the median time of each contender over CUDA events (contenders timed
round-robin, one call each per round), the ratio to the first contender and the effective bandwidth
(bytes the operation must move / time) as a fraction of the roof. Goals: our fused Adam at
>= 90% of the roof and <= 1.0x torch's fused AdamW; 1-bit compress and unpack at >= 80% of the roof.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

import lightning_optim.optim as lo
from lightning_optim import ops
from lightning_optim.comm import pieces as passes
from lightning_optim.comm.plan import plan_for

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import save  # noqa: E402

GB = 1e9
ROWS: list[dict] = []  # every printed row, for --json


def gpu_timed(fns, repeat: int, warmup: int = 3) -> list[float]:
    """Median seconds of each of ``fns`` (CUDA events), round-robin so drift hits all alike."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for fn, bucket in zip(fns, times):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            bucket.append(start.elapsed_time(end) / 1e3)
    return [statistics.median(b) for b in times]


def roof(repeat: int) -> float:
    """Device-to-device copy of 2 GB: (read + written bytes) / time."""
    src = torch.empty(500_000_000, device="cuda")
    dst = torch.empty_like(src)
    (t,) = gpu_timed([lambda: dst.copy_(src)], repeat)
    del src, dst
    torch.cuda.empty_cache()
    return 8 * 500_000_000 / t / GB


def row(name: str, t: float, base: float | None, nbytes: float, top: float, case: str = "") -> None:
    ratio = f"{t / base:6.2f}x" if base else "   ref "
    bw = nbytes / t / GB
    print(f"  {name:46s} {1e3 * t:9.3f} ms  {ratio}  {bw:7.0f} GB/s ({100 * bw / top:3.0f}% roof)")
    ROWS.append(dict(case=case, contender=name.strip(), ms=1e3 * t, ratio=t / base if base else 1.0,
                     gbps=bw, roof_pct=100 * bw / top))


def make(sizes, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    params = [torch.randn(s, device="cuda", generator=gen).requires_grad_() for s in sizes]
    for p in params:
        p.grad = torch.randn(p.shape, device="cuda", generator=gen)
    return params


def stepper(opt, backend: str | None):
    def step():
        if backend is None:
            os.environ.pop(ops.ENV_VAR, None)
        else:
            os.environ[ops.ENV_VAR] = backend
        opt.step()

    return step


def adamw_case(title: str, sizes, repeat: int, ext, top: float) -> None:
    total = sum(torch.Size(s).numel() for s in sizes)
    print(f"\n{title}: {total / 1e6:.0f}M fp32 params in {len(sizes)} tensors (28 B/param moved)")
    ps = [p.detach() for p in make(sizes)]
    gs = [torch.randn_like(p) for p in ps]
    ms, vs = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
    contenders = [
        ("torch.optim.AdamW(fused=True)", stepper(torch.optim.AdamW(make(sizes), lr=1e-3, fused=True), None)),
        ("torch.optim.AdamW(foreach=True)", stepper(torch.optim.AdamW(make(sizes), lr=1e-3, foreach=True), None)),
        ("lightning_optim.AdamW, cuda kernels", stepper(lo.AdamW(make(sizes), lr=1e-3), "cuda")),
        ("  of which the kernel call (ext.adam)",
         lambda: ext.adam(ps, gs, ms, vs, [], [], [], 0.1, 0.999, 0.001, -1e-3, 1.0, 1e-8, 0.0, 1.0, -0.0, True)),
        ("lightning_optim.AdamW, torch backend", stepper(lo.AdamW(make(sizes), lr=1e-3), "torch")),
    ]
    times = gpu_timed([fn for _, fn in contenders], repeat)
    for i, ((name, _), t) in enumerate(zip(contenders, times)):
        row(name, t, times[0] if i else None, 28 * total, top, case=title)
    os.environ.pop(ops.ENV_VAR, None)


def onebit_case(n: int, repeat: int, ext, top: float) -> None:
    print(f"\n1-bit error feedback on the GPU, {n / 1e6:.0f}M fp32 values")
    x, err = torch.randn(n, device="cuda"), torch.randn(n, device="cuda") * 0.01
    packed = torch.empty(n // 8, dtype=torch.uint8, device="cuda")
    out = torch.empty(n, device="cuda")
    pieces = plan_for(n, 1, None).worker.on(x.device)
    given, ones = torch.full((1,), 0.5, device="cuda"), torch.ones(1, device="cuda")

    def torch_compress():  # the same math in torch ops: z = x + err, scale, sign bits, err = z - scale * sign
        z = x + err
        scale = torch.linalg.vector_norm(z) / n**0.5
        bits = z >= 0
        torch.sub(z, torch.where(bits, scale, -scale), out=err)
        weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8, device="cuda")
        torch.sum(bits.view(-1, 8).to(torch.uint8) * weights, dim=1, dtype=torch.uint8, out=packed)

    def kernel_compress():
        scales = pieces.scales(passes.sumsq(x, err, pieces))
        passes.compress(x, err, packed, scales, pieces, add_err=True)

    contenders = [
        ("torch ops (add, norm, ge, where, sub, pack)", torch_compress, 20.125 * n),
        ("kernel: sumsq + compress (scale = |z|/sqrt(n))", kernel_compress, 20.125 * n),
        ("kernel: compress, scale given (1 pass)", lambda: passes.compress(x, err, packed, given, pieces,
                                                                            add_err=True), 12.125 * n),
        ("kernel: sumsq alone", lambda: passes.sumsq(x, err, pieces), 8 * n),
        ("unpack: kernel (per-piece scale)", lambda: passes.unpack(packed, ones, out, pieces), 4.125 * n),
        ("unpack: torch (bit shifts, where)", lambda: torch.where(
            (packed.view(-1, 1) >> torch.arange(7, -1, -1, device="cuda", dtype=torch.uint8)) & 1 == 1,
            1.0, -1.0).view(-1), 4.125 * n),
    ]
    times = gpu_timed([fn for _, fn, _ in contenders], repeat)
    for i, ((name, _, nbytes), t) in enumerate(zip(contenders, times)):
        row(name, t, times[0] if i else None, nbytes, top, case=f"1-bit, {n / 1e6:.0f}M fp32 values")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=25)
    parser.add_argument("--json", default=None, help="also write the roof and every row to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kernels_cuda.py needs a CUDA GPU")
    ext = ops.build()
    if not ext.with_cuda():
        raise SystemExit("the extension was built without CUDA (nvcc or a CUDA torch missing at build time)")
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB; torch "
          f"{torch.__version__} (CUDA {torch.version.cuda})")
    top = roof(args.repeat)
    print(f"memory roof: device-to-device copy, {top:.0f} GB/s (read + written)")
    adamw_case("AdamW, 8 big tensors", [(25_000_000,)] * 8, args.repeat, ext, top)
    adamw_case("AdamW, many small tensors", [(5_000,)] * 2000, args.repeat, ext, top)
    adamw_case("AdamW, GPT-2-small-like layout", gpt2_layout(), args.repeat, ext, top)
    onebit_case(200_000_000, args.repeat, ext, top)
    found = dict(device=props.name, sms=props.multi_processor_count, cuda=torch.version.cuda, torch=torch.__version__,
                 roof_gbps=top, rounds=args.repeat, rows=ROWS)
    save("kernels_cuda", found)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(found, f, indent=1)


def gpt2_layout():
    """The parameter shapes of GPT-2 small (124M): 12 blocks of attention + MLP + 2 LayerNorms."""
    d, v, ctx = 768, 50257, 1024
    block = [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return [(v, d), (ctx, d)] + block * 12 + [(d,), (d,)]


if __name__ == "__main__":
    main()
