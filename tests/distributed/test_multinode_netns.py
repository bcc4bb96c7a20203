"""The simulated clusters behind the multinode tests and `moesys bench alltoall` (runtime/bench/netns.py): hosts reach
each other on their own addresses, a cut host is unreachable, rails route cross-rail traffic through the spine, and
nothing of a cluster is left behind, also when its body fails or its process was killed."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from runtime.bench.netns import PREFIX, ClusterUnavailable, RailCluster, SimulatedCluster, _our_namespaces

CONNECT = ("import socket, sys\n"
           "try:\n"
           "    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1).close(); print('open')\n"
           "except OSError as e:\n"
           "    print(type(e).__name__)\n")
LISTEN = "import socket, time; s = socket.create_server(('0.0.0.0', 29411)); print('ready', flush=True); time.sleep(30)"


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
    from runtime.bench.alltoall import run_alltoall_bench
    from runtime.errors import UserError

    cfg = resolve_config(["recipe=tiny", "train.micro_batch_size=2", "train.seq_len=32"])
    try:
        result = run_alltoall_bench(cfg, host_links_mbit=(), rail_spines_mbit=(100,), rounds=1, warmup=0)
    except UserError as exc:
        pytest.skip(str(exc))
    assert result["exact"] is True
    assert result["payload"]["rows_per_rank"] == [2 * 32 * 2] * 4  # micro-batch x sequence x top-k, dropless
    assert set(result["by_case"]) == {"rails_nic_1000mbit_spine_100mbit"}
