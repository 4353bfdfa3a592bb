"""Compiled kernels vs torch, side by side in one process.

    python benchmarks/kernels.py            # all cases
    python benchmarks/kernels.py --quick    # smaller sizes, fewer repeats

Prints the machine, its memory roof (an in-place 4-read/3-write fp32 pass on the kernels' own
driver), then per case the median step time of each contender (the optimizer contenders of a case
are timed round-robin, one step each per round), the ratio to torch, and the effective bandwidth
(bytes the update must move / time) as a fraction of the roof.
Run on a quiet machine (check ``uptime``): the figures are memory-bound and any other job skews them.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import time

import torch

import lightning_optim.optim as lo
from lightning_optim import ops
from lightning_optim.comm import packing
from lightning_optim.comm import pieces as passes
from lightning_optim.comm.plan import plan_for
from results import save

GB = 1e9
CASES: list[dict] = []  # every case measured, with its rows, for results.save


def machine() -> str:
    model = platform.processor() or "?"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        model = fields.get("Model name", model).strip()
        flags = fields.get("Flags", "").split()
        simd = " ".join(f for f in ("avx2", "avx512f", "avx512bw", "avx512_bf16", "f16c") if f in flags)
    except OSError:
        simd = "?"
    return (f"{model}, {os.cpu_count()} logical CPUs, torch threads {torch.get_num_threads()}, SIMD: {simd}; "
            f"torch {torch.__version__}, Python {platform.python_version()}; load {os.getloadavg()[0]:.2f}")


def timed(fn, repeat: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def interleaved(fns, repeat: int, warmup: int = 2) -> list[float]:
    """Median time of each of ``fns``, timed round-robin so that a noisy minute hits all alike."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    times = [[] for _ in fns]
    for _ in range(repeat):
        for fn, bucket in zip(fns, times):
            t = time.perf_counter()
            fn()
            bucket.append(time.perf_counter() - t)
    return [statistics.median(bucket) for bucket in times]


def roof(ext, n: int, repeat: int) -> float:
    a, b, c, d = (torch.rand(n) for _ in range(4))
    t = timed(lambda: ext.cpu_roof(a, b, c, d), repeat)
    return 28 * n / t / GB


def make(sizes, dtype=torch.float32, grad_dtype=None):
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in sizes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(grad_dtype or dtype)
    return params


def flat_params(sizes):
    """``make(sizes)`` rehomed by ``flatten_parameters`` (params and grads each one buffer, as views)."""
    params = make(sizes)
    lo.flatten_parameters(params)
    return params


def optimizer_step(opt_factory, params, backend: str | None):
    opt = opt_factory(params)

    def step():
        if backend is not None:
            os.environ[ops.ENV_VAR] = backend
        opt.step()

    return step


def row(name: str, t: float, base: float | None, nbytes: float | None, top: float) -> None:
    ratio = f"{t / base:6.2f}x" if base else "   ref "
    bw = f"{nbytes / t / GB:6.1f} GB/s ({100 * nbytes / t / GB / top:3.0f}% roof)" if nbytes else ""
    print(f"  {name:44s} {1e3 * t:9.2f} ms  {ratio}  {bw}")
    CASES[-1]["rows"].append({"contender": name.strip(), "ms": 1e3 * t, "ratio": t / base if base else None,
                              "GBps": nbytes / t / GB if nbytes else None,
                              "roof_pct": 100 * nbytes / t / GB / top if nbytes else None})


def case(title: str, **facts) -> None:
    """Start a new case: ``row`` adds to the last one."""
    CASES.append({"case": title, **facts, "rows": []})


def adamw_case(title, sizes, repeat, ext, deepspeed):
    total = sum(torch.Size(s).numel() for s in sizes)
    top = roof(ext, 40_000_000 // (10 if total < 5_000_000 else 1), repeat)
    print(f"\n{title}: {total / 1e6:.0f}M params in {len(sizes)} tensors (28 B/param moved); roof now {top:.1f} GB/s")
    case(title, params=total, tensors=len(sizes), bytes_per_param=28, roof_GBps=top)
    params = make(sizes)
    ms, vs, gs = [torch.zeros(s) for s in sizes], [torch.zeros(s) for s in sizes], [p.grad for p in params]
    ps = [p.detach() for p in params]
    contenders = [
        ("torch.optim.AdamW(fused=True)", optimizer_step(lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True),
                                                         make(sizes), None)),
        ("torch.optim.AdamW(foreach=True)", optimizer_step(lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=True),
                                                           make(sizes), None)),
        ("lightning_optim.AdamW, torch backend", optimizer_step(lambda p: lo.AdamW(p, lr=1e-3), make(sizes), "torch")),
        ("lightning_optim.AdamW, cpu kernels", optimizer_step(lambda p: lo.AdamW(p, lr=1e-3), params, "cpu")),
        ("  of which the kernel call (ext.adam)",
         lambda: ext.adam(ps, gs, ms, vs, [], [], [], 0.1, 0.999, 0.001, -1e-3, 1.0, 1e-8, 0.0, 1.0, -0.0, True)),
        ("lightning_optim.AdamW, cpu kernels, flat params", optimizer_step(lambda p: lo.AdamW(p, lr=1e-3),
                                                                          flat_params(sizes), "cpu")),
    ]
    if deepspeed is not None:
        contenders.append(("deepspeed DeepSpeedCPUAdam",
                           optimizer_step(lambda p: deepspeed(p, lr=1e-3, adamw_mode=True), make(sizes), None)))
    times = interleaved([fn for _, fn in contenders], repeat)
    for i, ((name, _), t) in enumerate(zip(contenders, times)):
        row(name, t, times[0] if i else None, 28 * total, top)
    os.environ.pop(ops.ENV_VAR, None)


def bf16_case(ext, n_tensors, total, repeat):
    sizes = [(total // n_tensors,)] * n_tensors
    top = roof(ext, total, repeat)
    print(f"\nAdam, bf16 params + fp32 state + Kahan: {total / 1e6:.0f}M params in {n_tensors} tensors (26 B/param "
          f"with bf16 grads); roof now {top:.1f} GB/s")
    case("Adam, bf16 params + fp32 state + Kahan, bf16 grads", params=total, tensors=n_tensors, bytes_per_param=26,
         roof_GBps=top)
    # the kernel alone, bf16 grads read directly: p 2+2, g 2, m 4+4, v 4+4, comp 2+2 = 26 B/param
    params = make(sizes, torch.bfloat16)
    states = [[torch.zeros(s) for s in sizes] for _ in range(2)]
    comps = [torch.zeros(s, dtype=torch.bfloat16) for s in sizes]
    grads = [p.grad for p in params]
    ps = [p.detach() for p in params]

    def kernel():
        ext.adam(ps, grads, states[0], states[1], [], comps, [], 0.1, 0.999, 0.001, -1e-3, 1.0, 1e-8, 0.0, 1.0, -0.0,
                 True)

    def adam(backend):
        return optimizer_step(lambda p: lo.Adam(p, lr=1e-3, fp32_state=True), make(sizes, torch.bfloat16), backend)

    contenders = [("lightning_optim.Adam, torch backend", adam("torch")),
                  ("lightning_optim.Adam, cpu kernels (bf16 grads)", adam("cpu")),
                  ("kernel alone, bf16 grads (ext.adam)", kernel)]
    times = interleaved([fn for _, fn in contenders], repeat)
    for i, ((name, _), t) in enumerate(zip(contenders, times)):
        row(name, t, times[0] if i else None, 26 * total, top)
    os.environ.pop(ops.ENV_VAR, None)


def onebit_case(ext, n, repeat):
    top = roof(ext, n, repeat)
    print(f"\n1-bit error feedback, {n / 1e6:.0f}M fp32 values; roof now {top:.1f} GB/s")
    case("1-bit error feedback", values=n, roof_GBps=top)
    x, err = torch.randn(n), torch.randn(n) * 0.01
    packed = torch.empty((n + 7) // 8, dtype=torch.uint8)
    z, bits, index = torch.empty(n), torch.empty(n, dtype=torch.bool), torch.empty(n // 8, dtype=torch.int64)
    table = packing.sign_table(torch.float32)

    def torch_compress():  # what comm/compressed.py's worker does with torch ops
        torch.add(x, err, out=z)
        scale = torch.linalg.vector_norm(z) / n**0.5
        torch.ge(z, 0, out=bits)
        packing.pack_bits_(bits, packed)
        packing.unpack_into(packed, err, table * scale, index)
        torch.sub(z, err, out=err)

    # traffic of the fused form: pass 1 reads x, err (8 B); pass 2 reads x, err, writes err, bits (12.125 B)
    nbytes = 20.125 * n
    base = timed(torch_compress, repeat)
    row("torch ops (add, norm, ge, pack, unpack, sub)", base, None, nbytes, top)
    # the compiled passes of compressed_allreduce's worker, one segment (n a multiple of 8: no padding)
    pieces = plan_for(n, 1, None).worker.on(x.device)

    def kernel_compress():
        scales = pieces.scales(passes.sumsq(x, err, pieces))
        passes.compress(x, err, packed, scales, pieces, add_err=True)

    t = timed(kernel_compress, repeat)
    row("kernel: compress + pack (scale = |z|/sqrt(n))", t, base, nbytes, top)
    print(f"  {'':44s} = {4 * n / t / GB:.1f} GB/s of fp32 input")
    given = torch.full((1,), 0.5)
    t1 = timed(lambda: passes.compress(x, err, packed, given, pieces, add_err=True), repeat)
    row("kernel: compress + pack, scale given (1 pass)", t1, base, 12.125 * n, top)

    out = torch.empty(n)
    base = timed(lambda: packing.unpack_into(packed, out, table, index), repeat)
    row("unpack: torch (256x8 table, index_select)", base, None, 4.125 * n, top)
    ones = torch.ones(1)
    t = timed(lambda: passes.unpack(packed, ones, out, pieces), repeat)
    row("unpack: kernel", t, base, 4.125 * n, top)
    print(f"  {'':44s} = {4 * n / t / GB:.1f} GB/s of fp32 output")
    t = timed(lambda: ext.onebit_unpack_table(packed, table, out), repeat)
    row("unpack: kernel, 256x8 table", t, base, 4.125 * n, top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    scale, repeat = (10, 5) if args.quick else (1, 11)
    ext = ops.build()
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam as deepspeed
    except Exception:  # not installed, or its op does not build here
        deepspeed = None
    print(machine())
    print(f"DeepSpeedCPUAdam: {'found' if deepspeed else 'not installed (skipped)'}")
    print("memory roof: an in-place pass reading 4 and writing 3 fp32 arrays (ext.cpu_roof), measured before"
          " each case")
    adamw_case("AdamW fp32, many small tensors", [(5000,)] * (2000 // scale), repeat, ext, deepspeed)
    adamw_case("AdamW fp32, 8 big tensors", [(5_000_000 // scale,)] * 8, repeat, ext, deepspeed)
    bf16_case(ext, 8, 40_000_000 // scale, repeat)
    onebit_case(ext, 25_000_000 // scale, repeat)
    save("kernels", {"machine": machine(), "deepspeed": bool(deepspeed), "rounds": repeat, "cases": CASES},
         keep=not args.quick)


if __name__ == "__main__":
    main()
