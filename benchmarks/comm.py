"""1-bit ``compressed_allreduce`` vs a full-precision fp32 averaging ``all_reduce``, 2 gloo ranks.

Both collectives run in the same processes on the same 25M-element fp32 tensor (interleaved,
after warmup); each timing is the slowest rank's, after a barrier; the median is reported, with
the time ratio fp32 / compressed (compression and decompression included), the bytes ratio from
``comm_stats()``, where the compressed call's time goes (compute vs. time inside collectives), and
the single-thread pack/unpack throughput.

    python benchmarks/comm.py                 # loopback (127.0.0.1), both ranks on this machine
    python benchmarks/comm.py --netns         # ranks in two network namespaces joined by a veth
                                              # pair shaped to --rate (default 1gbit) with tc tbf;
                                              # needs root + iproute2, exits 0 with a note otherwise
Options: --numel 25000000 --iters 7 --warmup 2 --threads 1 (torch threads per rank).
The --netns mode only uses 10.123.0.1/24 and 10.123.0.2/24 on the veth pair it creates inside its
own namespaces, and deletes the namespaces on exit (also on Ctrl-C / SIGTERM).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import lightning_optim.comm.compressed as compressed_mod
from lightning_optim.comm import allreduce_mean, comm_stats, compressed_allreduce, make_error_buffers
from lightning_optim.comm.packing import pack_bits_, sign_table, unpack_into
from results import machine_facts, save  # noqa: F401  (machine_facts: the other benchmarks import it from here)

NETNS_ADDRS = ("10.123.0.1", "10.123.0.2")


# ----------------------------------------------------------------------------- worker side
class _CollectiveTimer:
    """Wraps ``compressed.collective`` to add up the seconds spent inside collectives."""

    def __init__(self):
        self.seconds = 0.0
        self._inner = compressed_mod.collective

    def __call__(self, name, fn, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self._inner(name, fn, *args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def worker(args) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=args.rank, world_size=2,
                            init_method=f"tcp://{args.addr}:{args.port}", timeout=timedelta(seconds=600))
    world = dist.get_world_size()
    x = torch.randn(args.numel, generator=torch.Generator().manual_seed(args.rank))
    dense = x.clone()
    onebit = x.clone()
    worker_error, server_error = make_error_buffers(onebit)
    timer = _CollectiveTimer()
    compressed_mod.collective = timer

    times = {"fp32": [], "onebit": [], "onebit_in_collectives": []}
    bytes_per_call = {}
    for it in range(args.warmup + args.iters):
        for name in ("fp32", "onebit"):
            before = comm_stats().copy()
            timer.seconds = 0.0
            dist.barrier()
            start = time.perf_counter()
            if name == "fp32":
                allreduce_mean(dense)
            else:
                compressed_allreduce(onebit, worker_error, server_error)
            elapsed = time.perf_counter() - start
            delta = comm_stats() - before
            bytes_per_call[name] = (delta.bytes_sent, delta.fp32_equivalent_bytes)
            slowest = _slowest(elapsed)
            in_coll = _slowest(timer.seconds) if name == "onebit" else 0.0
            if it >= args.warmup:
                times[name].append(slowest)
                if name == "onebit":
                    times["onebit_in_collectives"].append(in_coll)
    if args.rank == 0:
        print("RESULT " + json.dumps({"times": times, "bytes": bytes_per_call}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- parent side
def pack_unpack_throughput(numel: int, threads: int, repeats: int = 5) -> dict:
    """Single-process GB/s of the packing primitives (fp32 bytes in / out)."""
    torch.set_num_threads(threads)
    numel = numel // 8 * 8
    x = torch.randn(numel)
    bits = torch.empty(numel, dtype=torch.bool)
    packed = torch.empty(numel // 8, dtype=torch.uint8)
    out = torch.empty(numel)
    index = torch.empty(numel // 8, dtype=torch.int64)
    table = sign_table(torch.float32)

    def pack():
        torch.ge(x, 0, out=bits)
        pack_bits_(bits, packed)

    def unpack():
        unpack_into(packed, out, table, index)

    result = {}
    for name, fn in (("pack", pack), ("unpack", unpack)):
        fn()
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        sec = statistics.median(samples)
        result[name] = {"ms": sec * 1e3, "GBps_fp32": numel * 4 / sec / 1e9}
    return result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(args, addr: str, port: int, prefixes=(None, None), envs=(None, None)) -> dict:
    procs = []
    for rank in range(2):
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--rank", str(rank),
               "--addr", addr, "--port", str(port), "--numel", str(args.numel),
               "--iters", str(args.iters), "--warmup", str(args.warmup), "--threads", str(args.threads)]
        if prefixes[rank]:
            cmd = list(prefixes[rank]) + cmd
        env = dict(os.environ, **(envs[rank] or {}))
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env))
    outputs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"benchmark workers failed: exit codes {[p.returncode for p in procs]}")
    for line in outputs[0].splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise SystemExit("rank 0 printed no result")


def report(args, res: dict, mode: str, pack: dict) -> None:
    t = res["times"]
    fp32 = statistics.median(t["fp32"])
    onebit = statistics.median(t["onebit"])
    in_coll = statistics.median(t["onebit_in_collectives"])
    sent, fp32_equiv = res["bytes"]["onebit"]
    dense_sent = res["bytes"]["fp32"][0]
    facts = machine_facts()
    print(f"# compressed allreduce benchmark ({mode}); {args.numel:,} fp32 elements, 2 ranks, "
          f"{args.threads} torch thread(s) per rank, median of {args.iters} after {args.warmup} warmup")
    print(f"machine: {facts['cpu']}, {facts['cores']} cores, torch {facts['torch']}, "
          f"python {facts['python']}; load average at the end: {facts['loadavg_1_5_15min']}")
    print(f"fp32 all_reduce (mean)   : {fp32 * 1e3:9.1f} ms   {dense_sent / 1e6:8.2f} MB sent/rank")
    print(f"1-bit compressed_allreduce: {onebit * 1e3:9.1f} ms   {sent / 1e6:8.2f} MB sent/rank "
          f"(fp32 ring equivalent {fp32_equiv / 1e6:.2f} MB)")
    print(f"  of which inside collectives: {in_coll * 1e3:.1f} ms; compression/decompression "
          f"compute: {(onebit - in_coll) * 1e3:.1f} ms")
    print(f"time ratio fp32/1-bit : {fp32 / onebit:6.2f}x   (goal >= 5x)")
    print(f"bytes ratio           : {fp32_equiv / sent:6.2f}x   (goal >= 30x)")
    print(f"pack   (x>=0 + 8 signs/byte): {pack['pack']['ms']:.1f} ms = {pack['pack']['GBps_fp32']:.2f} GB/s "
          f"of fp32 input; unpack (table): {pack['unpack']['ms']:.1f} ms = "
          f"{pack['unpack']['GBps_fp32']:.2f} GB/s of fp32 output (1 thread)")
    save("comm_netns" if args.netns else "comm_loopback",
         {"mode": mode, "numel": args.numel, "iters": args.iters, "warmup": args.warmup, "fp32_ms": fp32 * 1e3,
          "onebit_ms": onebit * 1e3, "onebit_in_collectives_ms": in_coll * 1e3, "time_ratio": fp32 / onebit,
          "fp32_bytes_per_rank": dense_sent, "onebit_bytes_per_rank": sent, "fp32_ring_equivalent": fp32_equiv,
          "bytes_ratio": fp32_equiv / sent, "pack": pack, "machine": facts})


def _run(cmd: list[str]) -> None:
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


class NetnsUnavailable(RuntimeError):
    """The namespaces could not be made here (not root, no iproute2, or not permitted)."""


@contextlib.contextmanager
def netns_pair(rate: str = "1gbit", addrs=NETNS_ADDRS):
    """Two network namespaces joined by a veth pair, each end shaped to ``rate`` with tc tbf.

    Yields ``(prefixes, envs)``: per rank, the command prefix (``ip netns exec <ns>``) and the
    environment (``GLOO_SOCKET_IFNAME``); rank r listens on ``addrs[r]``. Raises
    ``NetnsUnavailable`` before yielding where that is not possible. The namespaces (and the veth
    pair with them) are deleted on exit, also on SIGINT/SIGTERM. Used by onebit_step.py too.
    """
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        raise NetnsUnavailable("needs root and iproute2 (ip, tc)")
    tag = f"lo{os.getpid() % 100000}"
    spaces = (f"{tag}a", f"{tag}b")
    veths = (f"{tag}va", f"{tag}vb")

    def cleanup(*_):
        for ns in spaces:
            subprocess.run(["ip", "netns", "del", ns], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    old = {s: signal.signal(s, lambda *a: (cleanup(), sys.exit(130))) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            for ns in spaces:
                _run(["ip", "netns", "add", ns])
            _run(["ip", "link", "add", veths[0], "netns", spaces[0], "type", "veth",
                  "peer", "name", veths[1], "netns", spaces[1]])
            for ns, dev, addr in zip(spaces, veths, addrs):
                _run(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev])
                _run(["ip", "-n", ns, "link", "set", dev, "up"])
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])
                _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                      "rate", rate, "burst", "512kb", "latency", "50ms"])
        except (subprocess.CalledProcessError, OSError) as exc:
            detail = exc.stderr.decode().strip() if getattr(exc, "stderr", None) else str(exc)
            raise NetnsUnavailable(f"not permitted here ({detail})") from None
        yield [("ip", "netns", "exec", ns) for ns in spaces], [{"GLOO_SOCKET_IFNAME": dev} for dev in veths]
    finally:
        cleanup()
        for s, h in old.items():
            signal.signal(s, h)


def run_netns(args) -> None:
    try:
        with netns_pair(args.rate) as (prefixes, envs):
            pack = pack_unpack_throughput(args.numel, args.threads)
            res = _launch(args, NETNS_ADDRS[0], 29517, prefixes, envs)
            report(args, res, f"2 network namespaces, veth shaped to {args.rate} (tc tbf)", pack)
    except NetnsUnavailable as exc:
        print(f"--netns {exc}: skipped")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=25_000_000)
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--netns", action="store_true")
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--addr", default="127.0.0.1", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
    elif args.netns:
        run_netns(args)
    else:
        pack = pack_unpack_throughput(args.numel, args.threads)
        res = _launch(args, "127.0.0.1", _free_port(), envs=({"GLOO_SOCKET_IFNAME": "lo"},) * 2)
        report(args, res, "loopback 127.0.0.1", pack)


if __name__ == "__main__":
    main()
