"""What `moesys train launcher=multinode` decides before it starts torchrun on a node: who hosts the rendezvous, the
address it publishes and the interface collectives bind to, a fresh store per round, this node's logs, and a node
that cannot be reached is refused, or, once its job is lost, noticed."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from moesys_cli.resolve import resolve_config
from runtime.config import ConfigError
from runtime.errors import UserError
from runtime.launch.command import build_launch, check_node_address, rendezvous_join_s
from runtime.launch.node_watch import LostNodeWatch, reachable
from runtime.files.paths import node_logs
from tests.waiting import wait_until

NODE = ["recipe=tiny", "launcher=multinode", "topology.nodes=2", "topology.expert_parallel=4",
        "launcher.rdzv_endpoint=10.1.2.3:29400"]


def test_node_0_hosts_the_rendezvous_and_publishes_its_local_addr(tmp_path, monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")  # the user's choice wins
    spec = build_launch(resolve_config([*NODE, "launcher.node_rank=0", "launcher.local_addr=127.0.0.1"]), tmp_path)
    assert "--rdzv_conf=is_host=true,join_timeout=300,read_timeout=300" in spec.argv
    assert "--local_addr=127.0.0.1" in spec.argv
    assert spec.env == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "GLOO_SOCKET_IFNAME": "lo"}
    assert f"--log_dir={tmp_path / 'logs' / 'node0'}" in spec.argv
    other = build_launch(resolve_config([*NODE, "launcher.node_rank=1"]), tmp_path)
    # As long as for a peer in a collective; read_timeout too: it bounds a node's wait for node 0 to be started.
    assert "--rdzv_conf=is_host=false,join_timeout=300,read_timeout=300" in other.argv
    assert not any(a.startswith("--local_addr") for a in other.argv)
    assert other.env == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def test_the_dry_run_shows_the_environment_of_the_command(tmp_path):
    from tests.cli.conftest import run_moesys
    out = run_moesys("train", *NODE, "launcher.node_rank=1", f"train.run_dir={tmp_path}", "--dry-run")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1].startswith("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 ")


def test_node_logs_are_per_node_only_for_multinode(tmp_path):
    assert node_logs(tmp_path, resolve_config(["recipe=tiny"])) == tmp_path / "logs"
    assert node_logs(tmp_path, resolve_config([*NODE, "launcher.node_rank=1"])) == tmp_path / "logs" / "node1"


def test_a_node_rank_outside_the_nodes_is_refused():
    with pytest.raises(ConfigError, match=r"launcher.node_rank=2 must be in 0..1"):
        resolve_config([*NODE, "launcher.node_rank=2"])


def test_an_address_the_other_nodes_cannot_reach_is_refused_before_launch():
    with pytest.raises(UserError, match="name .localhost. resolves to a loopback address.*set launcher.local_addr"):
        check_node_address(None, hostname="localhost")
    with pytest.raises(UserError, match="launcher.local_addr=192.0.2.77 is not an address of this machine"):
        check_node_address("192.0.2.77")  # TEST-NET-1: never configured on a real machine
    check_node_address("127.0.0.1")  # one of this machine's: accepted
    check_node_address(None, hostname="192.0.2.77")  # a name that resolves to a routable address: accepted


def test_a_node_whose_workers_ended_and_whose_rendezvous_is_gone_is_lost():
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        open_endpoint = f"127.0.0.1:{listening.getsockname()[1]}"
        assert reachable(open_endpoint)
    closed_endpoint = open_endpoint  # nothing listens there any more
    assert not reachable(closed_endpoint)
    agent = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],  # a torchrun with no workers
                             stdin=subprocess.PIPE)
    try:
        watch = LostNodeWatch(agent.pid, closed_endpoint, grace_s=0.0, probe_every_s=0.0)
        reason = watch.lost() or watch.lost()
        assert reason and f"rendezvous endpoint {closed_endpoint} has not answered" in reason
        assert watch.reason == reason
        with socket.socket() as listening:
            listening.bind(("127.0.0.1", 0))
            listening.listen()
            alive = LostNodeWatch(agent.pid, f"127.0.0.1:{listening.getsockname()[1]}", grace_s=0.0,
                                  probe_every_s=0.0)
            assert alive.lost() is None and alive.lost() is None  # a rendezvous that answers: a restart, not lost
    finally:
        agent.kill()
        agent.wait()


def test_a_node_that_never_rejoined_is_named_with_the_failure_before_it(tmp_path):
    from runtime.launch.failure import last_error
    from runtime.launch.process import TorchrunLogs

    cfg = resolve_config([*NODE, "launcher.node_rank=0", "train.collective_timeout_s=5"])
    logs_dir = node_logs(tmp_path, cfg)
    logs_dir.mkdir(parents=True)
    timeout = ("Traceback (most recent call last):\n  File \"torchrun\", line 8, in <module>\n"
               "torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError\n")
    (logs_dir / "launcher.log").write_text(timeout)  # an earlier launch's
    launched_at = (logs_dir / "launcher.log").stat().st_size
    logs = TorchrunLogs(logs_dir)
    rank0 = logs_dir / "moesys_x1" / "attempt_0" / "0"
    rank0.mkdir(parents=True)
    (rank0 / "stderr.log").write_text("[rank0]: Traceback (most recent call last):\n"
                                      "[rank0]: RuntimeError: Read error [10.1.2.4]:1: Connection reset by peer\n")
    assert last_error(logs, logs_dir, cfg, launched_at).startswith("node 0 local rank 0: RuntimeError: Read error")
    with (logs_dir / "launcher.log").open("a") as log:
        log.write("W1124 starting\n" + timeout)  # this launch's torchrun gave up on the lost node
    message = last_error(logs, logs_dir, cfg, launched_at)
    assert message.startswith("the other nodes did not join the rendezvous at 10.1.2.3:29400 within 60 s")
    assert message.endswith("before that, node 0 local rank 0: RuntimeError: Read error [10.1.2.4]:1: Connection "
                            "reset by peer")


def test_a_node_that_could_not_reach_node_0s_store_names_the_endpoint(tmp_path):
    from runtime.launch.failure import last_error
    from runtime.launch.process import TorchrunLogs

    refused = ("Traceback (most recent call last):\n  File \"torchrun\", line 8, in <module>\n"
               "torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection to the C10d store "
               "has failed. See inner exception for details.\n")
    for rank, expected in ((1, "no connection to node 0's rendezvous store at launcher.rdzv_endpoint=10.1.2.3:29400: "
                                "node 0's moesys train is not running"),
                           (0, "node 0 could not host the rendezvous store at launcher.rdzv_endpoint=10.1.2.3:29400: "
                               "its port is in use")):
        cfg = resolve_config([*NODE, f"launcher.node_rank={rank}"])
        logs_dir = node_logs(tmp_path, cfg)
        logs_dir.mkdir(parents=True)
        (logs_dir / "launcher.log").write_text("W1124 starting\n" + refused)
        message = last_error(TorchrunLogs(logs_dir), logs_dir, cfg)
        assert message.startswith(expected) and "\n" not in message


AGENT = ("import subprocess, sys\nsys.stdin.readline()\n"
         "subprocess.run([sys.executable, '-c', 'import sys; sys.stdin.readline()', 'runtime.train.worker'])\n"
         "sys.stdin.read()\n")
"""A torchrun stand-in: no worker until a line arrives on its stdin, then one worker until the next line."""


def test_a_node_waits_the_join_grace_for_node_0_until_its_workers_ran_then_the_short_grace():
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        closed_endpoint = f"127.0.0.1:{listening.getsockname()[1]}"  # nothing listens there
    agent = subprocess.Popen([sys.executable, "-c", AGENT], stdin=subprocess.PIPE, text=True)
    try:
        watch = LostNodeWatch(agent.pid, closed_endpoint, grace_s=0.0, join_grace_s=3600.0, probe_every_s=0.0)
        assert watch.lost() is None and watch.lost() is None  # node 0 may not be started yet
        agent.stdin.write("go\n")
        agent.stdin.flush()

        def worker_seen() -> bool:
            assert watch.lost() is None
            return watch.started

        wait_until(worker_seen, what="the watch to see the worker", process=agent)
        agent.stdin.write("end\n")
        agent.stdin.flush()
        reason = wait_until(watch.lost, what="the node to be lost once its worker ended (the short grace)")
        assert reason.startswith(f"this node's workers have ended and the rendezvous endpoint {closed_endpoint}")
    finally:
        agent.kill()
        agent.wait()


def test_the_launcher_arms_thelost_node_watch_with_the_join_wait_before_the_first_workers():
    from types import SimpleNamespace

    from runtime.launch.follow import lost_node_watch

    cfg = resolve_config([*NODE, "launcher.node_rank=1", "train.collective_timeout_s=5"])
    watch = lost_node_watch(cfg, SimpleNamespace(started=SimpleNamespace(pid=1)))
    assert watch.grace_s == 10  # the cut-link case: a node whose workers ran ends soon
    assert rendezvous_join_s(cfg) == 60
    assert watch.join_grace_s > 2 * 60  # beyond torchrun's own give-up: two connects of read_timeout each
