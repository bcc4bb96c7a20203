"""`moesys plan` predicts each storage mode's step and chooses the split (schedule), through the real command;
`--measure` keeps this machine's rates in a profile that the next plan reads."""

from __future__ import annotations

import json

from tests.cli.conftest import run_moesys

SCHEDULE_KEYS = {"micro_batch_size", "grad_accum_steps", "recompute", "resident_layers", "predicted_tokens_per_s",
                 "predicted_vs_resident", "bound_term", "tokens_per_step_for_0_8"}


def test_plan_json_has_the_schedule_beside_the_suggestions_and_each_modes_step(tmp_path, monkeypatch):
    monkeypatch.setenv("MOESYS_CACHE_DIR", str(tmp_path / "cache"))
    out = run_moesys("plan", "recipe=tiny", "train.grad_accum_steps=auto", "train.recompute=auto", "--json",
                     cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert "suggestions" in data and SCHEDULE_KEYS <= set(data["schedule"])
    s = data["schedule"]
    assert s["micro_batch_size"] * s["grad_accum_steps"] == 8  # the recipe's 8 sequences a rank stay the batch
    assert s["chosen"] == ["train.grad_accum_steps", "train.recompute"]
    assert set(data["step_time"]) == {"none", "cpu", "ssd"}
    none, cpu = data["step_time"]["none"], data["step_time"]["cpu"]
    assert none["tokens_per_s"] > 0 and 0 < cpu["vs_none"] <= 1 and cpu["bound_term"] in ("gpu", "cpu_optimizer")
    assert cpu["terms_s"]["pcie"] == 0  # no GPU: nothing crosses a bus
    assert data["rates"]["gemm_tflops"] > 0 and "default" in data["rates"]["from"]


def test_plan_text_says_the_schedule_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("MOESYS_CACHE_DIR", str(tmp_path / "cache"))
    out = run_moesys("plan", "recipe=tiny", "storage.offload=cpu", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "step time predicted: none " in out.stdout
    line = next(line for line in out.stdout.splitlines() if line.startswith("schedule: "))
    assert " bound: " in line and "x resident at 2,048 tokens a step" in line


def test_auto_keys_take_the_plans_choice_and_bad_ones_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("MOESYS_CACHE_DIR", str(tmp_path / "cache"))
    out = run_moesys("config", "recipe=tiny", "train.grad_accum_steps=auto", "storage.resident_layers=auto",
                     cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "grad_accum_steps: 1" in out.stdout and "resident_layers: 0" in out.stdout
    bad = run_moesys("plan", "recipe=tiny", "storage=cpu", "train.recompute=block", cwd=tmp_path)
    assert bad.returncode == 2 and "use train.recompute=moe" in bad.stderr and "Traceback" not in bad.stderr


def test_measure_keeps_this_machines_rates_for_the_next_plan(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("MOESYS_CACHE_DIR", str(cache))
    measured = run_moesys("plan", "recipe=tiny", "train.max_steps=2", "--measure", cwd=tmp_path, timeout=600)
    assert measured.returncode == 0, measured.stderr
    assert "measured this machine: host AdamW" in measured.stdout
    profiles = list((cache / "machines").glob("*.json"))
    assert len(profiles) == 1
    profile = json.loads(profiles[0].read_text())
    assert profile["adamw_gparams_per_core"] > 0 and profile["gemm_tflops"] > 0 and profile["disk_read_gbps"] > 0
    assert len(profile["resident_mfu"]) == 1
    later = json.loads(run_moesys("plan", "recipe=tiny", "--json", cwd=tmp_path).stdout)
    assert later["rates"]["adamw_gparams_per_core"] == profile["adamw_gparams_per_core"]
    assert "resident_mfu profile" in later["rates"]["from"] and "gemm_tflops profile" in later["rates"]["from"]
    declared = json.loads(run_moesys("plan", "recipe=tiny", "launcher=slurm", "--json", cwd=tmp_path).stdout)
    assert "gemm_tflops default" in declared["rates"]["from"]  # a SLURM job runs elsewhere: the keys


def test_a_probe_job_that_fails_stops_measure_in_one_line_and_keeps_no_profile(tmp_path, monkeypatch):
    """The resident probe is a real job in the planned layout: one the launch refuses is said, not measured."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("MOESYS_CACHE_DIR", str(cache))
    out = run_moesys("plan", "recipe=tiny", "topology.cpu_memory_gb=0.01", "--measure", cwd=tmp_path, timeout=600)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "resident probe job failed (the plan says this run does not fit" in out.stderr
    assert "topology.resident_mfu" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert not list(cache.glob("machines/*.json"))
