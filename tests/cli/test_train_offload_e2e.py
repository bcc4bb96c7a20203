"""The user's commands for offloaded training, as typed: `moesys train recipe=tiny storage.offload=ssd|cpu` is two
torchrun processes with expert parallelism 2. Routing in the tiny recipe leaves experts without tokens on some
steps (a rank's whole block, at times); the losses must equal storage.offload=none, also on a busy machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.conftest import losses, run_moesys

pytestmark = pytest.mark.slow
STEPS = 40
"""Past step 20, where the missed zero-gradient AdamW steps of idle experts had moved losses 8% apart."""


def train(cwd: Path, name: str, *overrides: str, steps: int = STEPS) -> list[float]:
    proc = run_moesys("train", "recipe=tiny", f"train.max_steps={steps}", f"train.run_dir=runs/{name}", *overrides,
                      "--json", cwd=cwd, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = losses(cwd / "runs" / name)
    assert len(out) == steps
    return out


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("offload-e2e")


@pytest.fixture(scope="module")
def resident(workdir) -> list[float]:
    return train(workdir, "none")


def idle_steps(run_dir: Path) -> int:
    """Steps on which some local expert of some rank 0 layer received no tokens (4 layers x 4 local experts)."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return sum(1 for m in lines if m.get("offload/experts_active", 16) < 16)


@pytest.mark.parametrize("mode,resident_layers", [pytest.param("ssd", 0, marks=pytest.mark.extended), ("cpu", 0),
                                                   pytest.param("cpu", 1, marks=pytest.mark.extended)])
def test_offloaded_training_matches_resident(workdir, resident, mode, resident_layers):
    """The default cache (the plan's size for ssd; every local expert for cpu, where a smaller cache is moot); with
    storage.resident_layers=1 the first of the 4 MoE layers keeps its experts on the device."""
    name = f"{mode}-resident{resident_layers}"
    got = train(workdir, name, f"storage.offload={mode}", f"storage.resident_layers={resident_layers}")
    plan = json.loads((workdir / "runs" / name / "plan.json").read_text())["plan"]
    assert plan["placement"]["resident_layers"] == resident_layers, plan["placement"]
    assert idle_steps(workdir / "runs" / name) > 0
    assert got[-1] == pytest.approx(resident[-1], rel=1e-5)
    assert got == pytest.approx(resident, rel=1e-5)


@pytest.mark.extended
def test_a_two_expert_cache_matches_resident_under_cpu_contention(workdir, resident):
    """Evictions every step, and two busy processes competing for both cores: collective-ordering faults hide on
    an idle machine."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        got = train(workdir, "ssd-cache2-busy", "storage.offload=ssd", "storage.cpu_cache_experts=2")
    finally:
        for p in busy:
            p.kill()
            p.wait(timeout=10)
    assert idle_steps(workdir / "runs" / "ssd-cache2-busy") > 0
    metrics = [json.loads(line) for line in (workdir / "runs" / "ssd-cache2-busy" / "metrics.jsonl").read_text()
               .splitlines() if line.strip()]
    assert sum(m["offload/cache_evictions"] for m in metrics) > 0
    assert got[-1] == pytest.approx(resident[-1], rel=1e-5)
    assert got == pytest.approx(resident, rel=1e-5)


@pytest.mark.extended
def test_offload_with_dense_sharding_trains_like_dense_sharding_alone(workdir):
    """This pair hung at step 7 in the AlltoAll backward (with dense sharding's asynchronous all-gathers)."""
    ref = train(workdir, "ds-none", "storage.dense_shard=true", steps=20)
    got = train(workdir, "ds-ssd", "storage.dense_shard=true", "storage.offload=ssd", steps=20)
    assert got == pytest.approx(ref, rel=1e-5)
