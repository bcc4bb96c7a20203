"""`moesys train launcher=multinode` across two simulated hosts (network namespaces joined by a switch, runtime/bench/
netns.py), as on two machines: each host runs the command with its own launcher.node_rank and launcher.local_addr,
the c10d rendezvous and every collective cross the link, and the run directory is shared as on a cluster's
filesystem. Two processes per host, expert parallelism over all four, hierarchical AlltoAll across the hosts."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from runtime.bench.netns import ClusterUnavailable, SimulatedCluster
from tests.cli.conftest import FAST_TINY, losses, moesys_bin, run_moesys
from tests.waiting import wait_until

pytestmark = pytest.mark.slow
GLOBAL = ["topology.expert_parallel=4"]  # 4 ranks of micro-batch 4: the same global batch on one host or two


@pytest.fixture
def cluster():
    try:
        cluster = SimulatedCluster(hosts=2).__enter__()
    except ClusterUnavailable as exc:
        pytest.skip(f"no simulated cluster here: {exc}")
    try:
        yield cluster
    finally:
        cluster.close()  # kills whatever a failed test left running on the hosts


def start(cluster: SimulatedCluster, host: int, run_dir: Path, *overrides: str) -> subprocess.Popen:
    """`moesys train` on host `host`, as typed on that machine."""
    argv = [moesys_bin(), "train", *FAST_TINY, *GLOBAL, "launcher=multinode", "topology.nodes=2",
            "topology.nproc_per_node=2", f"launcher.node_rank={host}",
            f"launcher.local_addr={cluster.hosts[host].address}",
            f"launcher.rdzv_endpoint={cluster.hosts[0].address}:29400", f"train.run_dir={run_dir}", *overrides]
    return cluster.popen(host, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, COLUMNS="200"))


def wait_for_steps(run_dir: Path, steps: int, procs: list[subprocess.Popen], timeout: float = 120) -> None:
    """Until metrics.jsonl holds `steps` steps; fails if a host's job ends first (before the test could interrupt
    it)."""
    def reached() -> bool:
        if (run_dir / "metrics.jsonl").exists() and len(losses(run_dir)) >= steps:
            return True
        for host, p in enumerate(procs):
            if p.poll() is not None:
                raise AssertionError(f"host {host}'s job ended (exit code {p.returncode}) before the test could "
                                     f"interrupt it: {p.communicate()[1][-3000:]}")
        return False

    wait_until(reached, what=f"step {steps} on both hosts", timeout=timeout)


def a_worker(cluster: SimulatedCluster, host: int) -> psutil.Process:
    """One of the training processes on `host` (not its torchrun agent)."""
    for pid in cluster.pids(host):
        try:
            p = psutil.Process(pid)
            if "runtime.train.worker" in p.cmdline() and "LOCAL_RANK" in p.environ():
                return p
        except psutil.Error:
            continue
    raise AssertionError(f"no worker running on host {host}")


@pytest.mark.extended
def test_two_hosts_train_like_one_and_restart_together_after_a_killed_worker(cluster, tmp_path):
    one = run_moesys("train", *FAST_TINY, *GLOBAL, "topology.nproc_per_node=4", "train.max_steps=8",
                     "train.checkpoint_every=0", f"train.run_dir={tmp_path / 'one'}", cwd=tmp_path)
    assert one.returncode == 0, one.stderr

    run_dir = tmp_path / "two"
    args = ["train.max_steps=8", "train.checkpoint_every=3", "train.max_restarts=1", "parallel.alltoall=hierarchical"]
    hosts = [start(cluster, h, run_dir, *args) for h in (0, 1)]
    wait_for_steps(run_dir, 4, hosts)
    at_kill = len(losses(run_dir))
    a_worker(cluster, 1).send_signal(signal.SIGKILL)
    outs = [h.communicate(timeout=240) for h in hosts]
    checkpoint = 3 * (at_kill // 3)
    for h, (out, err) in zip(hosts, outs):
        assert h.returncode == 0, err
        # Host 1 counts its restart; host 0 restarts its workers too, counted when they failed on the lost peer
        # first, else as torchrun's uncounted restart for a node that rejoined.
        back = re.search(r"restarted( with the other nodes)? \((1 of 1 restarts|not counted in train\.max_restarts)\)"
                         r", back to step (\d+)", out)
        assert back and int(back.group(3)) in (checkpoint, checkpoint + 3), out
    assert "1 of 1 restarts" in outs[1][0]
    assert losses(run_dir) == losses(tmp_path / "one")  # bit for bit, across the restart
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["node0", "node1"]


@pytest.mark.extended
def test_a_cut_link_fails_both_hosts_within_the_collective_timeout(cluster, tmp_path):
    run_dir = tmp_path / "run"
    hosts = [start(cluster, h, run_dir, "train.max_steps=500", "train.checkpoint_every=0",
                   "train.collective_timeout_s=5", "train.max_restarts=0") for h in (0, 1)]
    wait_for_steps(run_dir, 2, hosts)
    cluster.cut(1)
    with ThreadPoolExecutor(len(hosts)) as pool:  # a host that waited on the lost link would not end
        outs = list(pool.map(lambda host: host.communicate(timeout=180), hosts))
    errors = []
    for h, (_, err) in zip(hosts, outs):
        assert h.returncode == 1, err
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(lines) == 1, err
        errors.append(lines[0])
    # Host 0 (the rendezvous) sees its peers time out; host 1, cut off, also ends instead of waiting on torchrun.
    assert "waited more than train.collective_timeout_s=5 s" in errors[0] and "node 0 local rank" in errors[0]
    assert "training failed on node 1" in errors[1] and "10.77.0.1:29400 has not answered" in errors[1]
    # Host 1's workers ran, so it gave up after the short lost-node grace, not the long wait for a node to join.
    assert "this node's workers have ended and the rendezvous endpoint" in errors[1]
