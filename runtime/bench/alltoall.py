"""Flat against hierarchical AlltoAll (the paper's "Resource-Aware Communication", Fig. 8) on 2 simulated hosts x 2
processes (runtime/bench/netns.py), in two topologies: one rate-limited link per host, the processes of a host on its
loopback (hosts joined by one slow link); and the rail-optimized network the paper built it for, where each rank has its
own NIC on the rail of its local rank and traffic between different rails crosses a slower spine. The payload is one MoE
layer's dispatch of the resolved config (micro_batch_size x seq_len tokens a rank, top_k rows each, hidden_size fp32
values a row, routed by a real router), sent with the AlltoAll the layer calls.

Both kinds run in every round, in alternating order, and the ratio of that round is taken (paired: a shared 2-core
machine drifts between seconds); the reported ratio is the median over rounds, with every round's ratio alongside.
The two must return exactly the same rows and counts on every rank, checked before timing: a difference fails the
benchmark without timing anything.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from runtime.bench.netns import Cluster, ClusterError, ClusterUnavailable, Host, RailCluster, SimulatedCluster
from runtime.config import MoesysConfig
from runtime.errors import UserError
from runtime.launch.process import exception_line

HOSTS, PER_HOST = 2, 2
HOST_LINKS_MBIT: tuple[float | None, ...] = (100, 1000, None)
"""One link per host (the processes of a host share it); None is the veth's own speed (several Gbit/s, CPU-bound)."""
RAIL_NIC_MBIT = 1000
RAIL_SPINES_MBIT: tuple[float, ...] = (100, 300, 1000)
"""Rail topology: every rank's NIC at RAIL_NIC_MBIT, the spine between rails at each of these."""
TARGET = 1.15
PORT = 29500
CASE_TIMEOUT_S = 600.0
"""The longest all processes of one case may take together."""


class HostsUnavailable(UserError):
    """This machine cannot simulate hosts (network namespaces, tc): the benchmark cannot run here at all."""


def _mbit(mbit: float | None) -> str:
    return "unlimited" if mbit is None else f"{mbit:g}mbit"


def _run_case(cluster: Cluster, placement: list[Host], spec: dict, root: Path, name: str) -> dict:
    """Start the 4 processes, rank r in placement[r]'s namespace; wait for them; return rank 0's result."""
    spec = {**spec, "out": str(root / f"{name}.json")}
    spec_path = root / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    procs: list[subprocess.Popen] = []
    deadline = time.monotonic() + CASE_TIMEOUT_S  # one for all: the ranks run together
    try:
        for rank, host in enumerate(placement):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(len(placement)), LOCAL_RANK=str(rank % PER_HOST),
                       MASTER_ADDR=placement[0].address, MASTER_PORT=str(PORT), GLOO_SOCKET_IFNAME=host.interface,
                       OMP_NUM_THREADS="1")
            with open(root / f"{name}.rank{rank}.log", "w") as log:
                procs.append(cluster.popen(host.index, [sys.executable, "-m", "runtime.bench.alltoall_worker",
                                                        str(spec_path)], env=env, stdout=log,
                                           stderr=subprocess.STDOUT))
        while True:
            codes = [p.poll() for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:  # its peers would only wait for it until their collective timeout
                rank = failed[0]
                raise UserError(f"moesys bench alltoall: case {name}, rank {rank} failed (exit code {codes[rank]}): "
                                f"{_last_words(root / f'{name}.rank{rank}.log')}")
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                late = [r for r, c in enumerate(codes) if c is None]
                raise UserError(f"moesys bench alltoall: case {name}, rank(s) {', '.join(map(str, late))} did not "
                                f"finish within {CASE_TIMEOUT_S:.0f} s")
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    try:
        result = json.loads(Path(spec["out"]).read_text())
    except (OSError, ValueError):
        raise UserError(f"moesys bench alltoall: case {name}: rank 0 ended without writing its result "
                        f"({_last_words(root / f'{name}.rank0.log')})") from None
    if not result.get("exact"):
        raise UserError(f"moesys bench alltoall: case {name}: flat and hierarchical AlltoAll returned different rows "
                        "or counts (nothing was timed); hierarchical AlltoAll is wrong here, a bug to report")
    return result


def _last_words(log: Path) -> str:
    """A failed rank's exception line, else its log's last line."""
    text = log.read_text(errors="replace") if log.exists() else ""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return (exception_line(text) or (lines[-1] if lines else "no output"))[:300]


def _summary(seconds: dict[str, list[float]]) -> dict:
    ratios = [f / h for f, h in zip(seconds["flat"], seconds["hierarchical"], strict=True)]
    ratio = statistics.median(ratios)
    return {"flat_ms": statistics.median(seconds["flat"]) * 1e3,
            "hierarchical_ms": statistics.median(seconds["hierarchical"]) * 1e3,
            "hierarchical_vs_flat": ratio, "hierarchical_vs_flat_rounds": ratios, "target_met": ratio >= TARGET}


def run_alltoall_bench(cfg: MoesysConfig, host_links_mbit: Sequence[float | None] = HOST_LINKS_MBIT,
                       rail_spines_mbit: Sequence[float] = RAIL_SPINES_MBIT, rounds: int = 15, warmup: int = 2,
                       seed: int = 0) -> dict:
    """Per topology and link rates: both kinds' median time (the slowest rank's) and the paired ratio."""
    model = cfg.model
    ranks = HOSTS * PER_HOST
    if model.num_experts % ranks:
        raise UserError(f"moesys bench alltoall splits model.num_experts={model.num_experts} over {ranks} processes; "
                        "choose a model whose experts divide by 4")
    tokens = cfg.train.micro_batch_size * cfg.train.seq_len
    spec = {"model": dataclasses.asdict(model), "tokens": tokens, "processes_per_host": PER_HOST, "seed": seed,
            "rounds": rounds, "warmup": warmup}
    cases: dict[str, dict] = {}
    results: list[dict] = []

    def measure(cluster: Cluster, placement: list[Host], name: str, **rates) -> None:
        results.append(_run_case(cluster, placement, spec, Path(tmp), name))
        cases[name] = {**rates, **_summary(results[-1]["seconds"])}

    try:
        with tempfile.TemporaryDirectory(prefix="moesys-bench-alltoall-") as tmp:
            if host_links_mbit:
                with SimulatedCluster(HOSTS) as cluster:
                    for mbit in host_links_mbit:
                        cluster.set_link_rate(mbit)
                        measure(cluster, [cluster.hosts[r // PER_HOST] for r in range(ranks)],
                                f"host_link_{_mbit(mbit)}", host_link_mbit=mbit)
            if rail_spines_mbit:
                with RailCluster(HOSTS, PER_HOST) as rails:
                    for spine in rail_spines_mbit:
                        rails.set_rates(RAIL_NIC_MBIT, spine)
                        measure(rails, rails.hosts, f"rails_nic_{_mbit(RAIL_NIC_MBIT)}_spine_{_mbit(spine)}",
                                nic_mbit=RAIL_NIC_MBIT, spine_mbit=spine)
    except ClusterUnavailable as exc:
        raise HostsUnavailable(f"moesys bench alltoall simulates hosts with network namespaces, which this machine "
                               f"cannot make ({exc}); run it as root on Linux with iproute2") from None
    except ClusterError as exc:
        raise UserError(f"moesys bench alltoall could not set up its simulated hosts: {exc}") from None
    rows = results[0]["rows_per_rank"]
    return {
        "hosts": HOSTS, "processes_per_host": PER_HOST, "rounds": rounds,
        "payload": {"tokens_per_rank": tokens, "top_k": model.top_k, "hidden": model.hidden_size, "dtype": "float32",
                    "experts": model.num_experts, "rows_per_rank": rows,
                    "mb_per_rank": statistics.mean(rows) * model.hidden_size * 4 / 1e6},
        "exact": all(r["exact"] for r in results),  # else _run_case failed
        "target": TARGET,
        "target_met_at": [name for name, case in cases.items() if case["target_met"]],
        "by_case": cases,
    }
