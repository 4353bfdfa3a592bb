"""Rank network namespaces on Linux bridges, shaped with tc tbf: flat (one bridge) or two-level (nodes).

``benchmarks/comm.py``'s ``netns_pair`` joins two namespaces by one veth pair; ``netns_bridge`` is its
N-rank form for ``benchmarks/scale_model.py --validate``: a hub namespace holds the bridge, every
rank namespace has one veth into it, and both ends of every veth are shaped to ``rate`` (tbf), so
each rank sends and receives at most ``rate``. ``netns_nodes`` is the two-level form for
``benchmarks/hierarchy.py``: one bridge per node (the node's rank veths unshaped), each node bridge joined
to a core bridge by an uplink veth shaped to ``rate`` at both ends, so only inter-node traffic is shaped and
all of a node's ranks share its uplink. Only 10.124.0.0/24 is used, inside namespaces this creates; they
are deleted on exit (also on SIGINT/SIGTERM).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

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


def _bridge(hub: str, name: str) -> None:
    _run(["ip", "-n", hub, "link", "add", name, "type", "bridge"])
    _run(["ip", "-n", hub, "link", "set", name, "up"])


def _attach_rank(tag: str, hub: str, ns: str, r: int, bridge: str) -> tuple[str, str]:
    """Rank ``r``'s namespace ``ns``: a veth (``eth0`` inside, ``p<r>`` in the hub on ``bridge``)."""
    inside, outside = "eth0", f"p{r}"
    _run(["ip", "link", "add", f"{tag}x{r}", "netns", ns, "type", "veth", "peer", "name", outside, "netns", hub])
    _run(["ip", "-n", ns, "link", "set", f"{tag}x{r}", "name", inside])
    _run(["ip", "-n", ns, "addr", "add", f"{rank_address(r)}/24", "dev", inside])
    _run(["ip", "-n", ns, "link", "set", inside, "up"])
    _run(["ip", "-n", ns, "link", "set", "lo", "up"])
    _run(["ip", "-n", hub, "link", "set", outside, "master", bridge])
    _run(["ip", "-n", hub, "link", "set", outside, "up"])
    return inside, outside


@contextlib.contextmanager
def _namespaces(count: int, build: Callable[[str, str, list[str]], object]) -> Iterator[tuple]:
    """A hub and ``count`` rank namespaces; ``build(tag, hub, ranks)`` wires them (its errors and the
    namespaces' become ``NetnsUnavailable``). Yields ``(prefixes, envs, built)``; deletes all on exit."""
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
            for ns in [hub, *ranks]:
                _run(["ip", "netns", "add", ns])
            built = build(tag, hub, ranks)
        except (subprocess.CalledProcessError, OSError) as exc:
            detail = exc.stderr.decode().strip() if getattr(exc, "stderr", None) else str(exc)
            raise NetnsUnavailable(f"not permitted here ({detail})") from None
        yield [("ip", "netns", "exec", ns) for ns in ranks], [{"GLOO_SOCKET_IFNAME": "eth0"} for _ in ranks], built
    finally:
        cleanup()
        for s, h in old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def netns_bridge(count: int, rate: str = "1gbit",
                 burst: str = "512kb") -> Iterator[tuple[list[tuple[str, ...]], list[dict[str, str]]]]:
    """``count`` rank namespaces on one bridge; yields per rank the command prefix and environment.

    ``burst``: the tbf bucket (comm.py's 512kb; 64kb made TCP lose a third of the rate at 3-4 ranks). A message
    that fits in a full bucket passes unshaped: time 1-bit phases of several MB.
    Rank ``r`` listens on ``rank_address(r)``. Raises ``NetnsUnavailable`` before yielding where
    namespaces cannot be made.
    """
    def build(tag: str, hub: str, ranks: list[str]) -> None:
        _bridge(hub, "br0")
        for r, ns in enumerate(ranks):
            inside, outside = _attach_rank(tag, hub, ns, r, "br0")
            _shape(ns, inside, rate, burst)
            _shape(hub, outside, rate, burst)

    with _namespaces(count, build) as (prefixes, envs, _):
        yield prefixes, envs


@dataclass(frozen=True)
class Uplinks:
    """The inter-node links of ``netns_nodes``: in namespace ``hub``, ``up<k>`` carries what leaves node k."""

    hub: str
    devices: tuple[str, ...]

    def tx_bytes(self) -> int:
        """Bytes that left any node so far (wire counters: Ethernet frames incl. TCP/IP headers)."""
        out = subprocess.run(["ip", "-n", self.hub, "-s", "-j", "link", "show"], check=True,
                             capture_output=True, text=True).stdout
        stats = {link["ifname"]: link["stats64"]["tx"]["bytes"] for link in json.loads(out)}
        return sum(stats[d] for d in self.devices)


@contextlib.contextmanager
def netns_nodes(nodes: int, per_node: int, rate: str = "1gbit",
                burst: str = "512kb") -> Iterator[tuple[list[tuple[str, ...]], list[dict[str, str]], Uplinks]]:
    """``nodes`` x ``per_node`` rank namespaces, node k holding ranks ``k*per_node .. k*per_node+per_node-1``.

    Ranks of a node share the node's bridge over unshaped veths; node bridge k reaches the core bridge over
    the veth ``up<k>`` / ``dn<k>``, both ends shaped to ``rate``. Yields per rank the command prefix and
    environment, and the ``Uplinks`` (their tx counters). Raises ``NetnsUnavailable`` before yielding."""
    if nodes < 2 or per_node < 1:
        raise ValueError(f"need nodes >= 2 and per_node >= 1, got {nodes} x {per_node}")

    def build(tag: str, hub: str, ranks: list[str]) -> Uplinks:
        _bridge(hub, "core")
        for k in range(nodes):
            _bridge(hub, f"node{k}")
            _run(["ip", "-n", hub, "link", "add", f"up{k}", "type", "veth", "peer", "name", f"dn{k}"])
            for dev, bridge in ((f"up{k}", f"node{k}"), (f"dn{k}", "core")):
                _run(["ip", "-n", hub, "link", "set", dev, "master", bridge])
                _run(["ip", "-n", hub, "link", "set", dev, "up"])
                _shape(hub, dev, rate, burst)
            for r in range(k * per_node, (k + 1) * per_node):
                _attach_rank(tag, hub, ranks[r], r, f"node{k}")
        return Uplinks(hub, tuple(f"up{k}" for k in range(nodes)))

    with _namespaces(nodes * per_node, build) as made:
        yield made


def run_node_ranks(prefixes: list[tuple[str, ...]], envs: list[dict[str, str]], per_node: int, argv: list[str],
                   port: int, timeout: float) -> dict:
    """Start one ``python argv...`` per rank of ``netns_nodes`` (torchrun's variables: RANK, WORLD_SIZE,
    LOCAL_RANK, LOCAL_WORLD_SIZE; rank 0's namespace is the rendezvous), wait for all, and return the JSON
    that rank 0 printed last on a ``RESULT `` line. Exits naming what failed (a timeout kills every rank)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    world = len(prefixes)
    procs = []
    for rank in range(world):
        env = dict(os.environ, **envs[rank], MASTER_ADDR=rank_address(0), MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(world), LOCAL_RANK=str(rank % per_node), LOCAL_WORLD_SIZE=str(per_node),
                   PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        procs.append(subprocess.Popen([*prefixes[rank], sys.executable, *argv], stdout=subprocess.PIPE, text=True,
                                      env=env))
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise SystemExit(f"ranks still running after {timeout} s: killed") from None
    if any(p.returncode for p in procs):
        raise SystemExit(f"ranks failed: exit codes {[p.returncode for p in procs]}")
    lines = [line for line in outputs[0].splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise SystemExit("rank 0 printed no result")
    return json.loads(lines[-1][len("RESULT "):])
