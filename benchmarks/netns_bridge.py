"""N network namespaces joined by a Linux bridge, each rank's veth shaped with tc tbf.

``benchmarks/comm.py``'s ``netns_pair`` joins two namespaces by one veth pair; this is its
N-rank form for ``benchmarks/scale_model.py --validate``: a hub namespace holds the bridge, every
rank namespace has one veth into it, and both ends of every veth are shaped to ``rate`` (tbf), so
each rank sends and receives at most ``rate``. Only 10.124.0.0/24 is used, inside namespaces this
creates; they are deleted on exit (also on SIGINT/SIGTERM).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator

SUBNET = "10.124.0"


class NetnsUnavailable(RuntimeError):
    """The namespaces could not be made here (not root, no iproute2, or not permitted)."""


def rank_address(rank: int) -> str:
    return f"{SUBNET}.{rank + 1}"


def _run(cmd: list[str]) -> None:
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _shape(namespace: str, device: str, rate: str, burst: str) -> None:
    _run(["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device, "root", "tbf",
          "rate", rate, "burst", burst, "latency", "50ms"])


@contextlib.contextmanager
def netns_bridge(count: int, rate: str = "1gbit",
                 burst: str = "512kb") -> Iterator[tuple[list[tuple[str, ...]], list[dict[str, str]]]]:
    """``count`` rank namespaces on one bridge; yields per rank the command prefix and environment.

    ``burst``: the tbf bucket (comm.py's 512kb; 64kb made TCP lose a third of the rate at 3-4 ranks). A message
    that fits in a full bucket passes unshaped: time 1-bit phases of several MB.
    Rank ``r`` listens on ``rank_address(r)``. Raises ``NetnsUnavailable`` before yielding where
    namespaces cannot be made.
    """
    if count < 2:
        raise ValueError(f"count must be >= 2, got {count}")
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        raise NetnsUnavailable("needs root and iproute2 (ip, tc)")
    tag = f"sb{os.getpid() % 100000}"
    hub = f"{tag}hub"
    ranks = [f"{tag}r{r}" for r in range(count)]

    def cleanup(*_: object) -> None:
        for ns in [*ranks, hub]:
            subprocess.run(["ip", "netns", "del", ns], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    old = {s: signal.signal(s, lambda *a: (cleanup(), sys.exit(130))) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            _run(["ip", "netns", "add", hub])
            _run(["ip", "-n", hub, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", hub, "link", "set", "br0", "up"])
            for r, ns in enumerate(ranks):
                inside, outside = "eth0", f"p{r}"
                _run(["ip", "netns", "add", ns])
                _run(["ip", "link", "add", f"{tag}x{r}", "netns", ns, "type", "veth",
                      "peer", "name", outside, "netns", hub])
                _run(["ip", "-n", ns, "link", "set", f"{tag}x{r}", "name", inside])
                _run(["ip", "-n", ns, "addr", "add", f"{rank_address(r)}/24", "dev", inside])
                _run(["ip", "-n", ns, "link", "set", inside, "up"])
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])
                _run(["ip", "-n", hub, "link", "set", outside, "master", "br0"])
                _run(["ip", "-n", hub, "link", "set", outside, "up"])
                _shape(ns, inside, rate, burst)
                _shape(hub, outside, rate, burst)
        except (subprocess.CalledProcessError, OSError) as exc:
            detail = exc.stderr.decode().strip() if getattr(exc, "stderr", None) else str(exc)
            raise NetnsUnavailable(f"not permitted here ({detail})") from None
        yield [("ip", "netns", "exec", ns) for ns in ranks], [{"GLOO_SOCKET_IFNAME": "eth0"} for _ in ranks]
    finally:
        cleanup()
        for s, h in old.items():
            signal.signal(s, h)
