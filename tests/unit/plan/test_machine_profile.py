"""The rates a plan uses: a topology.* key where set, else this machine's profile when the job runs here, else the
documented default; the profile cache is one small file per machine, written atomically, with a bounded model list."""

from __future__ import annotations

import dataclasses
import json

from runtime.config import LauncherConfig, MoesysConfig, TopologyConfig
from runtime.plan.machine_profile import (DEFAULT_RATES, MAX_MODELS, machine_identity, machine_rates, model_key,
                                          profile_path, read_profile, write_profile)


def test_keys_win_over_the_profile_which_wins_over_the_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv("MOESYS_CACHE_DIR", str(tmp_path))
    cfg = MoesysConfig(topology=TopologyConfig(cpu_cores_per_node=4))
    rates = machine_rates(cfg)
    assert read_profile() is None
    assert rates.adamw_params_per_s_per_core == DEFAULT_RATES["adamw_gparams_per_core"] * 1e9
    assert rates.cores == 4 and dict(rates.sources)["adamw_gparams_per_core"] == "default"
    write_profile({"adamw_gparams_per_core": 0.5, "disk_read_gbps": 3.0}, model_key(cfg), 0.2)
    rates = machine_rates(cfg)
    assert rates.adamw_params_per_s_per_core == 0.5e9 and rates.disk_read_bytes_per_s == 3e9
    assert rates.resident_mfu == 0.2 and dict(rates.sources)["resident_mfu"] == "profile"
    keyed = dataclasses.replace(cfg, topology=dataclasses.replace(cfg.topology, adamw_gparams_per_core=0.1))
    assert machine_rates(keyed).adamw_params_per_s_per_core == 0.1e9
    assert dict(machine_rates(keyed).sources)["adamw_gparams_per_core"] == "key"


def test_a_declared_cluster_or_a_gpu_topology_on_a_cpu_machine_ignores_the_profile(tmp_path, monkeypatch):
    monkeypatch.setenv("MOESYS_CACHE_DIR", str(tmp_path))
    write_profile({"adamw_gparams_per_core": 0.5})
    slurm = MoesysConfig(launcher=LauncherConfig(name="slurm"))
    assert machine_rates(slurm).adamw_params_per_s_per_core == DEFAULT_RATES["adamw_gparams_per_core"] * 1e9
    assert machine_rates(slurm).cores == DEFAULT_RATES["cpu_cores_per_node"]
    gpus = MoesysConfig(topology=TopologyConfig(gpus_per_node=8, gpu_memory_gb=80))
    here_has_gpus = bool(machine_identity()["gpus"])
    assert (machine_rates(gpus).adamw_params_per_s_per_core == 0.5e9) == here_has_gpus


def test_the_profile_is_one_file_per_machine_keeping_the_newest_models(tmp_path, monkeypatch):
    monkeypatch.setenv("MOESYS_CACHE_DIR", str(tmp_path))
    for i in range(MAX_MODELS + 3):
        path = write_profile({"gemm_tflops": float(i)}, f"model{i}", 0.1 + i / 100)
    assert path == profile_path() and list((tmp_path / "machines").iterdir()) == [path]
    data = json.loads(path.read_text())
    assert data["gemm_tflops"] == MAX_MODELS + 2 and data["identity"] == machine_identity()
    assert list(data["resident_mfu"]) == [f"model{i}" for i in range(3, MAX_MODELS + 3)]
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temporary file left


def test_an_unreadable_profile_is_no_profile(tmp_path, monkeypatch):
    monkeypatch.setenv("MOESYS_CACHE_DIR", str(tmp_path))
    profile_path().parent.mkdir(parents=True)
    profile_path().write_text("{not json")
    assert read_profile() is None
    assert dict(machine_rates(MoesysConfig()).sources)["gemm_tflops"] == "default"
