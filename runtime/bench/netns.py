"""Simulated clusters on one Linux machine, for tests and `moesys bench alltoall` (root and iproute2 needed).

`SimulatedCluster`: each host a network namespace with its own address, the hosts joined by a bridge, each host's link
optionally rate-limited with `tc tbf`; the processes of a host share its namespace and talk on its loopback.
`RailCluster`: the rail-optimized topology of the paper's "Resource-Aware Communication" (Fig. 7): each rank a namespace
with its own NIC on the rail of its local rank, the ranks of a host joined by a fast intra-host bridge (the NVSwitch),
same-rail traffic between hosts crossing one switch, cross-rail traffic routed through a spine with its own rate limit.

Nothing is created in the caller's namespace: bridges, veth pairs and addresses live inside namespaces named
`moesys-netns-<pid>-...`, so deleting those removes every interface, and the addresses cannot clash with the
machine's. Leftovers of a process that was killed are removed by the next cluster.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

PREFIX = "moesys-netns-"
INTERFACE = "eth0"
"""A host's (or rank's) interface to its switch: what GLOO_SOCKET_IFNAME names."""


COMMAND_TIMEOUT_S = 30
"""The longest one ip or tc command may take."""


class ClusterError(RuntimeError):
    """An ip or tc command that builds or changes a cluster failed or did not answer: the command and why, on one
    line."""


class ClusterUnavailable(ClusterError):
    """Namespaces cannot be made here (not root, no iproute2, no namespace support, no tbf qdisc): the reason, on one
    line."""


@dataclass(frozen=True)
class Host:
    index: int
    namespace: str
    address: str
    """Its address on the cluster network (on INTERFACE)."""
    port: str
    """Its link's end in the switch namespace."""
    interface: str = INTERFACE


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    """Run an ip or tc command for at most COMMAND_TIMEOUT_S; check: raise ClusterError unless it succeeded (else a
    command that did not answer has return code 124)."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        done = subprocess.CompletedProcess(list(argv), 124, "", f"no answer within {COMMAND_TIMEOUT_S} s")
    if check and done.returncode != 0:
        raise ClusterError(f"{' '.join(argv)}: {_why(done)}")
    return done


def _why(done: subprocess.CompletedProcess) -> str:
    """A failed command's error output on one line, or its exit code."""
    return " ".join(done.stderr.split()) or f"exit code {done.returncode}"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run(["ip", *args], check=check)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _our_namespaces() -> list[str]:
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    return [line.split()[0] for line in listed if line.startswith(PREFIX)]


def _delete_namespace(name: str) -> None:
    """Kill what still runs inside it (started in it by a cluster of ours), then delete it with its interfaces."""
    for pid in _ip("netns", "pids", name, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _ip("netns", "del", name, check=False)


def remove_leftovers() -> list[str]:
    """Delete the namespaces of clusters whose process is gone (killed before it could clean up)."""
    removed = []
    for name in _our_namespaces():
        found = re.match(rf"{re.escape(PREFIX)}(\d+)-", name)
        if found and not _pid_alive(int(found.group(1))):
            _delete_namespace(name)
            removed.append(name)
    return removed


def _rate_limit(namespace: str, device: str, mbit: float | None) -> None:
    """tbf on the device's egress (None: no limit), with a burst of a few packets and a queue of 50 ms at the
    rate, as a switch port would buffer."""
    _run(["tc", "-n", namespace, "qdisc", "del", "dev", device, "root"], check=False)  # none there: fine
    if mbit is not None:
        burst = max(16_000, int(mbit * 1e6 / 8 / 250))
        done = _run(["tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "tbf", "rate", f"{mbit}mbit",
                     "burst", str(burst), "latency", "50ms"], check=False)
        if done.returncode != 0:
            raise ClusterUnavailable(f"tc cannot rate-limit a link with a tbf qdisc ({_why(done)}); the kernel's "
                                     "sch_tbf module may be missing (modprobe sch_tbf)")


class Cluster:
    """Namespaces made by this process, removed on exit (also when the body raised or was interrupted)."""

    _made_clusters = 0

    def __init__(self) -> None:
        Cluster._made_clusters += 1
        self.tag = f"{PREFIX}{os.getpid()}-{Cluster._made_clusters}"
        self.switch = f"{self.tag}-sw"
        self.hosts: list[Host] = []
        self._made: list[str] = []

    def __enter__(self):
        if shutil.which("ip") is None or shutil.which("tc") is None:
            raise ClusterUnavailable("iproute2 (ip, tc) is not installed")
        remove_leftovers()
        try:
            self._add_namespace(self.switch)
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _create(self) -> None:
        raise NotImplementedError

    def _add_namespace(self, name: str) -> None:
        done = _ip("netns", "add", name, check=False)
        if done.returncode != 0:
            raise ClusterUnavailable(f"cannot create a network namespace: {done.stderr.strip()}")
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _bridge(self, name: str, address: str | None = None) -> None:
        _ip("-n", self.switch, "link", "add", name, "type", "bridge")
        if address:
            _ip("-n", self.switch, "addr", "add", address, "dev", name)
        _ip("-n", self.switch, "link", "set", name, "up")

    def _plug(self, namespace: str, device: str, address: str, port: str, bridge: str) -> None:
        """A veth from `namespace` (device, address) to a port of `bridge` in the switch namespace."""
        _ip("-n", namespace, "link", "add", device, "type", "veth", "peer", "name", port, "netns", self.switch)
        _ip("-n", self.switch, "link", "set", port, "master", bridge, "up")
        _ip("-n", namespace, "addr", "add", address, "dev", device)
        _ip("-n", namespace, "link", "set", device, "up")

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """argv run inside the namespace of hosts[host]."""
        return ["ip", "netns", "exec", self.hosts[host].namespace, *argv]

    def popen(self, host: int, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(host, argv), **kwargs)

    def pids(self, host: int) -> list[int]:
        """The processes running inside the namespace of hosts[host]."""
        return [int(p) for p in _ip("netns", "pids", self.hosts[host].namespace, check=False).stdout.split()]

    def close(self) -> None:
        """Kill every process left inside the namespaces and delete them (which deletes their interfaces)."""
        for name in reversed(self._made):
            _delete_namespace(name)
        self._made.clear()


class SimulatedCluster(Cluster):
    """`hosts` namespaces joined by one bridge; `link_mbit` rate-limits every host's link (None: veth speed)."""

    def __init__(self, hosts: int = 2, link_mbit: float | None = None):
        super().__init__()
        if not 1 <= hosts <= 250:
            raise ValueError(f"hosts={hosts} must be 1..250")
        self.hosts = [Host(i, f"{self.tag}-h{i}", f"10.77.0.{i + 1}", f"p{i}") for i in range(hosts)]
        self.link_mbit = link_mbit

    def _create(self) -> None:
        self._bridge("br0")
        for host in self.hosts:
            self._add_namespace(host.namespace)
            self._plug(host.namespace, INTERFACE, f"{host.address}/24", host.port, "br0")
        self.set_link_rate(self.link_mbit)

    def set_link_rate(self, mbit: float | None) -> None:
        """Rate-limit every host's link in both directions (the host's egress and the switch port's egress toward
        it); None removes the limit."""
        for host in self.hosts:
            _rate_limit(host.namespace, INTERFACE, mbit)
            _rate_limit(self.switch, host.port, mbit)
        self.link_mbit = mbit

    def cut(self, host: int) -> None:
        """Unplug a host from the switch: its packets are dropped silently, as when a cable or a switch fails
        (no error reaches the processes; only their timeouts can notice)."""
        _ip("-n", self.switch, "link", "set", self.hosts[host].port, "nomaster")

    def reconnect(self, host: int) -> None:
        _ip("-n", self.switch, "link", "set", self.hosts[host].port, "master", "br0")


class RailCluster(Cluster):
    """`hosts` x `ranks_per_host` ranks, rank r = host r // ranks_per_host, local rank q = r % ranks_per_host.

    Rank (h, q) has a NIC (INTERFACE, 10.77.q.h+1) on rail q's switch and a link to its host's intra-host bridge.
    Same-host traffic takes the intra-host bridge; same-rail traffic between hosts crosses rail q's switch at
    `nic_mbit`; cross-rail traffic between hosts is routed through the spine, whose egress into each rail is
    limited to `spine_mbit`. hosts[r] is rank r's namespace.
    """

    def __init__(self, hosts: int = 2, ranks_per_host: int = 2, nic_mbit: float | None = None,
                 spine_mbit: float | None = None):
        super().__init__()
        if not (1 <= hosts <= 250 and 1 <= ranks_per_host <= 250):
            raise ValueError(f"hosts={hosts} and ranks_per_host={ranks_per_host} must be 1..250")
        self.num_hosts, self.ranks_per_host = hosts, ranks_per_host
        self.hosts = [Host(r, f"{self.tag}-h{r // ranks_per_host}r{r % ranks_per_host}",
                           f"10.77.{r % ranks_per_host}.{r // ranks_per_host + 1}", f"p{r}")
                      for r in range(hosts * ranks_per_host)]
        self.nic_mbit, self.spine_mbit = nic_mbit, spine_mbit

    def _create(self) -> None:
        _ip("netns", "exec", self.switch, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        for q in range(self.ranks_per_host):
            self._bridge(f"rail{q}", f"10.77.{q}.254/24")  # the spine's leg on rail q: the rail's gateway
        for h in range(self.num_hosts):
            self._bridge(f"host{h}")
        for rank in self.hosts:
            h, q = divmod(rank.index, self.ranks_per_host)
            self._add_namespace(rank.namespace)
            self._plug(rank.namespace, INTERFACE, f"{rank.address}/24", rank.port, f"rail{q}")
            self._plug(rank.namespace, "nv0", f"10.78.{h}.{q + 1}/24", f"n{rank.index}", f"host{h}")
            for peer in range(self.ranks_per_host):  # the NICs of the same host: over the intra-host bridge
                if peer != q:
                    _ip("-n", rank.namespace, "route", "add", f"10.77.{peer}.{h + 1}/32", "dev", "nv0")
            _ip("-n", rank.namespace, "route", "add", "default", "via", f"10.77.{q}.254")
        self.set_rates(self.nic_mbit, self.spine_mbit)

    def set_rates(self, nic_mbit: float | None, spine_mbit: float | None) -> None:
        """Every NIC's link in both directions, and the spine's egress into each rail (only routed, cross-rail
        traffic leaves a bridge through its own device); None removes a limit."""
        for rank in self.hosts:
            _rate_limit(rank.namespace, INTERFACE, nic_mbit)
            _rate_limit(self.switch, rank.port, nic_mbit)
        for q in range(self.ranks_per_host):
            _rate_limit(self.switch, f"rail{q}", spine_mbit)
        self.nic_mbit, self.spine_mbit = nic_mbit, spine_mbit
