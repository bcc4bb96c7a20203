"""tests/gpu/finetune_shape.py at toy dims on the CPU: the GPU lease's fine-tuning script writes a Qwen3-MoE with
transformers, fine-tunes it on chat data with recipe=finetune as a timed offload-train job, and sets the plan beside
what the job measured, so that a lease spends its minutes on the GPU's figures rather than on the script."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")


def test_the_fine_tuning_gpu_script_runs_its_jobs_and_compares_them_with_the_plan():
    from tests.gpu.finetune_shape import main

    out = main(240.0, "tiny", ("cpu",), [])
    assert out["dims"] == "tiny" and out["parameters"] > 0
    cpu = out["bench"]["cpu"]
    assert cpu.get("tokens_per_s", 0) > 0, cpu
    assert cpu["bound_term"] in ("gpu", "pcie", "cpu_optimizer", "disk") and cpu["alpha"] > 0
    (rank0, *_) = out["plan_compare"]["cpu"]["ranks"]
    assert rank0["tiers"]["ram"]["measured_bytes"] > 0 and rank0["tiers"]["ram"]["predicted_bytes"] > 0
