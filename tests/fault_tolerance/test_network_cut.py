"""A replica group cut off the network mid-run: the survivors go on with the replicas that are left.

Each replica group (``replica.py``, a separate launch) runs in its own Linux network namespace with one veth
into a bridge; torchft's Lighthouse (``torchft_lighthouse``, as users run it) runs in a namespace of its own on
the same bridge. Taking one replica's bridge port down cuts it off without closing a connection: no reset, no
error, only silence - the survivors find out from the collective timeout or the Lighthouse's missing
heartbeats, not from a closed socket as when a process dies. Each namespace is one machine with a host name of its
own that the others resolve (torchft's checkpoint server, which heals a replica that joins late, advertises the
host name). Needs root, iproute2 and util-linux's ``unshare`` (skipped otherwise).
"""
from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest

from tests.fault_tolerance.harness import Replicas, committed_checksums

pytest.importorskip("torchft")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or not all(map(shutil.which, ("ip", "unshare", "torchft_lighthouse"))),
                       reason="network namespaces need root, iproute2 (ip) and util-linux (unshare); the Lighthouse "
                              "needs torchft_lighthouse (torchft's console script)"),
]

SUBNET = "10.125.0"  # only inside the namespaces this file makes: nothing changes in the test's own namespace
IP = shutil.which("ip") or "ip"
ETC_NETNS = Path("/etc/netns")  # ip netns exec mounts /etc/netns/NS/hosts over /etc/hosts
LIGHTHOUSE_PORT = 29510
COLLECTIVE_TIMEOUT = 5.0  # the replicas' --timeout: bound of each collective and commit decision
HEARTBEAT_TIMEOUT = 2.0  # the Lighthouse's: a replica silent this long is out of the next quorum
JOIN_TIMEOUT = 1.0  # the Lighthouse's: how long a quorum waits for the replicas of the last one
OPTIONS = dict(steps=100, sync_every=10, step_sleep=0.1, outer_lr=1.0, outer_momentum=0.5)
CUT_AFTER = 15  # r2's inner step after which its link goes down (in its next quorum)


def ip(*args: str) -> str:
    done = subprocess.run([IP, *args], capture_output=True, text=True, timeout=10)
    if done.returncode:
        raise OSError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


@dataclass(frozen=True)
class Net:
    """Namespaces on one bridge, each one machine: ``spaces[name]`` (its namespace and host name),
    ``address[name]``, ``port[name]`` (its bridge port in the ``hub`` namespace)."""

    hub: str
    spaces: dict[str, str]
    address: dict[str, str]
    port: dict[str, str]

    def prefix(self, name: str) -> list[str]:
        """Run a command as machine ``name``: in its network namespace, under its own host name (torchft's
        checkpoint server advertises ``socket.gethostname()``; every namespace's /etc/hosts names them all)."""
        return [IP, "netns", "exec", self.spaces[name], "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', self.spaces[name]]

    def set_link(self, name: str, state: str) -> None:
        ip("-n", self.hub, "link", "set", self.port[name], state)

    def pids(self, name: str) -> list[str]:
        return ip("netns", "pids", self.spaces[name]).split()


@contextlib.contextmanager
def bridged(*names: str) -> Iterator[Net]:
    """One namespace per name, each with ``eth0`` (its own address) on a bridge in a hub namespace, and an
    /etc/hosts (``ip netns exec`` mounts /etc/netns/NS/hosts) naming every namespace's address; all removed on
    exit, also on failure."""
    tag = f"ftc{os.getpid() % 100000}"
    hub = f"{tag}hub"
    net = Net(hub, {n: f"{tag}{n}" for n in names}, {n: f"{SUBNET}.{i + 1}" for i, n in enumerate(names)},
              {n: f"p{i}" for i, n in enumerate(names)})
    hosts = "127.0.0.1 localhost\n" + "".join(f"{net.address[n]} {net.spaces[n]}\n" for n in names)
    made: list[str] = []
    etc_netns_existed = ETC_NETNS.exists()
    try:
        try:
            ip("netns", "add", hub)
        except OSError as exc:  # root without the right to make namespaces (an unprivileged container)
            pytest.skip(f"network namespaces are not permitted here ({exc})")
        made.append(hub)
        for ns in net.spaces.values():
            ip("netns", "add", ns)
            made.append(ns)
        ip("-n", hub, "link", "add", "br0", "type", "bridge")
        ip("-n", hub, "link", "set", "br0", "up")
        for i, name in enumerate(names):
            ns, port = net.spaces[name], net.port[name]
            ip("link", "add", f"{tag}x{i}", "netns", ns, "type", "veth", "peer", "name", port, "netns", hub)
            ip("-n", ns, "link", "set", f"{tag}x{i}", "name", "eth0")
            ip("-n", ns, "addr", "add", f"{net.address[name]}/24", "dev", "eth0")
            for dev in ("lo", "eth0"):
                ip("-n", ns, "link", "set", dev, "up")
            ip("-n", hub, "link", "set", port, "master", "br0")
            ip("-n", hub, "link", "set", port, "up")
            (ETC_NETNS / ns).mkdir(parents=True, exist_ok=True)
            (ETC_NETNS / ns / "hosts").write_text(hosts)
        yield net
    finally:
        for ns in reversed(made):
            subprocess.run([IP, "netns", "del", ns], capture_output=True, timeout=10)
            shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)
        if not etc_netns_existed:
            with contextlib.suppress(OSError):
                ETC_NETNS.rmdir()


@contextlib.contextmanager
def lighthouse(net: Net, workdir: Path) -> Iterator[str]:
    """``torchft_lighthouse`` in the namespace ``lighthouse``; yields its address once it listens. Its log (each
    quorum request it receives) goes to ``workdir``/lighthouse.log."""
    log = workdir / "lighthouse.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([*net.prefix("lighthouse"), "torchft_lighthouse", "--min_replicas", "1",
                                 "--join_timeout_ms", str(int(JOIN_TIMEOUT * 1000)), "--quorum_tick_ms", "100",
                                 "--heartbeat_timeout_ms", str(int(HEARTBEAT_TIMEOUT * 1000)),
                                 "--bind", f"0.0.0.0:{LIGHTHOUSE_PORT}"], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "RUST_LOG": "info"}, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while "listening on" not in log.read_text():
            assert proc.poll() is None, f"torchft_lighthouse exited ({proc.returncode}):\n{log.read_text()}"
            assert time.monotonic() < deadline, f"torchft_lighthouse not listening within 30 s:\n{log.read_text()}"
            time.sleep(0.05)
        yield f"http://{net.address['lighthouse']}:{LIGHTHOUSE_PORT}"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def in_namespaces(net: Net) -> dict[str, dict]:
    """Every replica's launch options: under its namespace, advertising its own address, gloo on its eth0."""
    return {r: {"prefix": net.prefix(r), "host": net.address[r], "env": {"GLOO_SOCKET_IFNAME": "eth0"}}
            for r in ("r0", "r1", "r2")}


def final_eval(events: list[dict]) -> float:
    done = [e for e in events if e.get("done")]
    assert done, f"no final evaluation in {events[-1:]}"
    return done[0]["eval"]


def steps_of(events: list[dict]) -> list[dict]:
    return [e for e in events if "loss" in e]


def quorum_requests(log: Path, replica: str) -> list[float]:
    """When the Lighthouse received each quorum request of ``replica`` (from its log: local time, ms)."""
    return [datetime.fromisoformat(line[:23]).timestamp() for line in log.read_text().splitlines()
            if f"Received quorum request for replica {replica}:" in line]


def wait_until(condition, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}"
        time.sleep(0.02)


def test_replica_cut_off_by_its_link(tmp_path: Path) -> None:
    """r2 runs ahead of r0 and r1 and waits for them in every quorum; once it is past inner step 15, its link goes
    down while its next quorum request is in the Lighthouse. The Lighthouse still counts r2 in (its heartbeat is
    fresh), so the survivors' round has a silent peer: it fails after the collective timeout and is discarded; the
    next quorum leaves r2 out. r0 and r1 keep stepping, finish every step, commit the later rounds as two, never
    apply a partial exchange, and end within 5% of the failure-free run's loss. r2, stuck, is killed; nothing of
    the run is left."""
    (tmp_path / "free").mkdir()
    (tmp_path / "cut").mkdir()
    lighthouse_log = tmp_path / "cut" / "lighthouse.log"
    ahead = {"step_sleep": 0.0}  # r2: no pause between its steps
    with bridged("lighthouse", "r0", "r1", "r2") as net:
        # the failure-free run of the same replicas, on loopback beside it (a Lighthouse in this process)
        with Replicas(tmp_path / "free", timeout=90, **OPTIONS) as free_run:
            free_run.start("r0", "r1", "r2", only={"r2": ahead}, timeout=COLLECTIVE_TIMEOUT)
            with lighthouse(net, tmp_path / "cut") as address, \
                    Replicas(tmp_path / "cut", lighthouse=address, timeout=90, **OPTIONS) as run:
                replicas = in_namespaces(net)
                replicas["r2"].update(ahead)
                run.start("r0", "r1", "r2", only=replicas, timeout=COLLECTIVE_TIMEOUT)
                run.wait_for("r2", lambda e: e["t"] >= CUT_AFTER, f"r2 at inner step {CUT_AFTER}")
                asked = len(quorum_requests(lighthouse_log, "r2"))
                wait_until(lambda: len(quorum_requests(lighthouse_log, "r2")) > asked,
                           "r2's next quorum request in the Lighthouse's log", 30)
                net.set_link("r2", "down")
                cut_at = time.time()
                asked_at = quorum_requests(lighthouse_log, "r2")[asked]
                cut = run.wait_all(["r0", "r1"])
                assert run.procs["r2"].poll() is None, f"r2 finished though cut off:\n{run.log('r2')}"
                run.kill("r2")
                cut["r2"] = run.read("r2")
            free = free_run.wait_all()
        # how long after the cut each survivor asked for the quorum r2 was waiting in (> 0: r2 was counted in)
        margin = {name: min(t for t in quorum_requests(lighthouse_log, name) if t > asked_at) - cut_at
                  for name in ("r0", "r1")}
        left = {name: net.pids(name) for name in net.spaces}
        assert not any(left.values()), f"processes left in the namespaces: {left}"

    # the failure-free run ends with all three in every round, none discarded
    assert all(steps_of(events)[-1]["participants"] == 3 and events[-1]["discarded"] == 0 for events in free.values())
    stalls, discarded = {}, {}
    for name in ("r0", "r1"):
        events = steps_of(cut[name])
        assert [e["t"] for e in events] == list(range(1, OPTIONS["steps"] + 1)), name
        before = max(e["s"] for e in events if e["time"] < cut_at)
        # the round r2 was counted in failed everywhere and was discarded; all later ones committed as two
        discarded[name] = events[-1]["discarded"]
        assert discarded[name] >= 1, (f"{name}: no round discarded after the cut (its quorum request came "
                                      f"{margin[name]:+.2f} s after the cut):\n{run.log(name)}")
        after = [e for e in events if e["s"] > before]
        assert after and all(e["participants"] == 2 for e in after), (name, after[:3])
        assert len({e["s"] for e in after}) >= 5, (name, sorted({e["s"] for e in after}))
        times = [e["time"] for e in events]
        stalls[name] = max(b - a for a, b in itertools.pairwise(times))
        assert stalls[name] < 3 * COLLECTIVE_TIMEOUT + HEARTBEAT_TIMEOUT + JOIN_TIMEOUT, (name, stalls[name])
    # no partial exchange applied: the survivors took the same decision in every round (the same committed step
    # and global params after every inner step), and at every committed step every launch holds the same params
    history = {name: [(e["t"], e["s"], e["crc"]) for e in steps_of(cut[name])] for name in ("r0", "r1")}
    assert history["r0"] == history["r1"]
    for runs in (free, cut):
        split = {s: crcs for s, crcs in committed_checksums(runs).items() if len(crcs) > 1}
        assert not split, f"launches differ at committed steps {split}"
    assert final_eval(cut["r0"]) == final_eval(cut["r1"])
    reference, survivors = final_eval(free["r0"]), final_eval(cut["r0"])
    print(f"eval loss: failure-free {reference:.5f}, survivors {survivors:.5f} ({survivors / reference - 1:+.2%}); "
          f"survivors' longest gap between steps {stalls}; rounds discarded {discarded}; the survivors asked for "
          f"the quorum r2 waited in {margin} s after the cut")
    assert abs(survivors - reference) <= 0.05 * reference, (survivors, reference)
