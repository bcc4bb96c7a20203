"""The simulated clusters behind the multinode tests and `moesys bench alltoall` (runtime/bench/netns.py): hosts reach
each other on their own addresses, a cut host is unreachable, rails route cross-rail traffic through the spine, and
nothing of a cluster is left behind, also when its body fails or its process was killed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.bench import alltoall, netns
from runtime.bench.netns import (PREFIX, ClusterError, ClusterUnavailable, Host, RailCluster, SimulatedCluster,
                                 _our_namespaces)
from runtime.errors import UserError

CONNECT = ("import socket, sys\n"
           "try:\n"
           "    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1).close(); print('open')\n"
           "except OSError as e:\n"
           "    print(type(e).__name__)\n")
LISTEN = ("import signal, socket; s = socket.create_server(('0.0.0.0', 29411)); print('ready', flush=True); "
          "signal.pause()")
"""A server that listens until it is killed."""
RUNS_ON = "import signal; signal.pause()"
"""A rank that runs until it is stopped."""


def _cluster(make):
    try:
        return make().__enter__()
    except ClusterUnavailable as exc:
        pytest.skip(f"no simulated cluster here: {exc}")


def test_hosts_reach_each_other_until_one_is_cut_and_nothing_is_left(tmp_path):
    cluster = _cluster(lambda: SimulatedCluster(hosts=2, link_mbit=100))
    names = [cluster.switch, *(h.namespace for h in cluster.hosts)]
    try:
        assert set(names) <= set(_our_namespaces())
        server = cluster.popen(0, [sys.executable, "-c", LISTEN], stdout=subprocess.PIPE, text=True)
        assert server.stdout.readline().strip() == "ready"

        def connect() -> str:
            argv = cluster.command(1, [sys.executable, "-c", CONNECT, cluster.hosts[0].address, "29411"])
            return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout.strip()

        assert connect() == "open"
        cluster.cut(1)
        assert connect() != "open"  # dropped silently: the connect times out
        cluster.reconnect(1)
        assert connect() == "open"
        assert server.pid in cluster.pids(0)
    finally:
        cluster.close()
    assert not set(names) & set(_our_namespaces())
    assert server.wait(timeout=10) != 0  # killed with its namespace


def test_a_failed_body_and_a_killed_owner_leave_nothing_behind():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    leftover = f"{PREFIX}{dead.pid}-1-sw"  # as a cluster of a process killed before its cleanup would leave it
    if shutil.which("ip") is None:
        pytest.skip("no iproute2 here")
    made = subprocess.run(["ip", "netns", "add", leftover], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"no network namespaces here: {made.stderr.strip()}")
    try:
        cluster = SimulatedCluster(hosts=2)
        names = [cluster.switch, *(h.namespace for h in cluster.hosts)]
        with pytest.raises(KeyError):
            with cluster:
                assert set(names) <= set(_our_namespaces())
                assert leftover not in _our_namespaces()  # removed when the cluster was made
                raise KeyError("the test body failed")
        assert not set(names) & set(_our_namespaces())
    finally:
        subprocess.run(["ip", "netns", "del", leftover], capture_output=True)


def test_rails_route_same_host_traffic_inside_the_host_and_cross_rail_traffic_through_the_spine():
    cluster = _cluster(lambda: RailCluster(hosts=2, ranks_per_host=2, nic_mbit=1000, spine_mbit=100))
    try:
        def route(src: int, dst: int) -> str:
            argv = ["ip", "-n", cluster.hosts[src].namespace, "route", "get", cluster.hosts[dst].address]
            return subprocess.run(argv, capture_output=True, text=True, check=True).stdout

        assert "dev nv0" in route(0, 1)  # same host, other rail: the intra-host bridge
        assert "via" not in route(0, 2) and "dev eth0" in route(0, 2)  # other host, same rail: one switch
        assert "via 10.77.0.254" in route(0, 3) and "via 10.77.1.254" in route(3, 0)  # other rail: the spine
        ready = cluster.popen(3, [sys.executable, "-c", LISTEN], stdout=subprocess.PIPE, text=True)
        assert ready.stdout.readline().strip() == "ready"
        probe = cluster.command(0, [sys.executable, "-c", CONNECT, cluster.hosts[3].address, "29411"])
        assert subprocess.run(probe, capture_output=True, text=True, timeout=30).stdout.strip() == "open"
    finally:
        cluster.close()


@pytest.mark.slow
def test_the_alltoall_bench_gets_the_same_rows_from_flat_and_hierarchical_across_hosts():
    from moesys_cli.resolve import resolve_config
    from runtime.bench.alltoall import HostsUnavailable, run_alltoall_bench

    cfg = resolve_config(["recipe=tiny", "train.micro_batch_size=2", "train.seq_len=32"])
    try:
        result = run_alltoall_bench(cfg, host_links_mbit=(), rail_spines_mbit=(100,), rounds=1, warmup=0)
    except HostsUnavailable as exc:  # only that: any other error is the benchmark's, and fails the test
        pytest.skip(str(exc))
    assert result["exact"] is True
    assert result["payload"]["rows_per_rank"] == [2 * 32 * 2] * 4  # micro-batch x sequence x top-k, dropless
    assert set(result["by_case"]) == {"rails_nic_1000mbit_spine_100mbit"}


# ---- failures of the cluster commands and of the benchmark's processes: one line each, nothing left running ----

def test_a_command_that_fails_or_hangs_is_one_line_and_a_missing_tbf_is_unavailable(monkeypatch):
    def run(argv, **kwargs):
        assert kwargs["timeout"] == netns.COMMAND_TIMEOUT_S  # every command is bounded
        if argv[0] == "ip":
            raise subprocess.TimeoutExpired(argv, kwargs["timeout"])
        if "add" in argv:
            return subprocess.CompletedProcess(argv, 2, "", "Error: Specified qdisc kind is unknown.\n")
        return subprocess.CompletedProcess(argv, 2, "", "Error: Cannot delete qdisc with handle of zero.\n")

    monkeypatch.setattr(netns.subprocess, "run", run)
    with pytest.raises(ClusterError, match=r"^ip -n ns link set lo up: no answer within 30 s$"):
        netns._ip("-n", "ns", "link", "set", "lo", "up")
    assert netns._ip("netns", "list", check=False).returncode == 124  # cleanup goes on
    netns._rate_limit("ns", "eth0", None)  # no qdisc to delete: fine
    with pytest.raises(ClusterUnavailable, match=r"tc cannot rate-limit a link with a tbf qdisc \(Error: Specified "
                                                 r"qdisc kind is unknown.\); the kernel's sch_tbf module"):
        netns._rate_limit("ns", "eth0", 100)


class Local:
    """A cluster stand-in that runs a fake rank per process here: `script(rank, spec_path)` is its Python code."""

    def __init__(self, script):
        self.script, self.started = script, []

    def popen(self, host: int, argv, **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", self.script(host, argv[-1])], **kwargs)
        self.started.append(proc)
        return proc


def run_case(script, tmp_path: Path) -> None:
    cluster = Local(script)
    placement = [Host(r, f"ns{r}", "127.0.0.1", f"p{r}", "lo") for r in range(4)]
    try:
        alltoall._run_case(cluster, placement, {"seed": 0}, tmp_path, "case")
    finally:
        assert len(cluster.started) == 4 and all(p.poll() is not None for p in cluster.started), \
            "a rank outlived its benchmark"


def test_a_failed_rank_fails_the_case_at_once_with_its_error(tmp_path, monkeypatch):
    def script(rank, spec):
        return "raise RuntimeError('gloo: connect refused')" if rank == 2 else RUNS_ON

    monkeypatch.setattr(alltoall, "CASE_TIMEOUT_S", 120.0)  # waiting for the peers would end in "did not finish"
    with pytest.raises(UserError, match=r"^moesys bench alltoall: case case, rank 2 failed \(exit code 1\): "
                                        r"RuntimeError: gloo: connect refused$"):
        run_case(script, tmp_path)  # and its peers, which never end on their own, were stopped


def test_the_ranks_of_a_case_share_one_deadline(tmp_path, monkeypatch):
    monkeypatch.setattr(alltoall, "CASE_TIMEOUT_S", 1.0)
    with pytest.raises(UserError, match=r"case case, rank\(s\) 0, 1, 2, 3 did not finish within 1 s"):
        run_case(lambda rank, spec: RUNS_ON, tmp_path)  # all four named at once: not one timeout per rank in turn


def test_flat_and_hierarchical_that_differ_fail_the_benchmark(tmp_path):
    def script(rank, spec):
        if rank:
            return "pass"
        return (f"import json; out = json.load(open({spec!r}))['out']\n"
                "json.dump({'exact': False, 'rows_per_rank': [1, 1, 1, 1], 'seconds': {}}, open(out, 'w'))")

    with pytest.raises(UserError, match="flat and hierarchical AlltoAll returned different rows or counts"):
        run_case(script, tmp_path)
    assert json.loads((tmp_path / "case.json").read_text())["exact"] is False
