"""`moesys plan train.init_from=DIR` plans a released model from its config.json alone (no weights there): its
parameter counts are transformers' own count of the model on the meta device, and Eq. 1 is printed per tier."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.cli.conftest import run_moesys

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
CONFIGS = Path(__file__).resolve().parents[1] / "data" / "hf_configs"


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen3-30b-a3b"])
def test_the_plan_of_a_released_model_counts_its_parameters_from_config_json(name):
    source = CONFIGS / name
    assert not list(source.glob("*.safetensors"))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(source))
    theirs = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    out = run_moesys("plan", "recipe=finetune", f"train.init_from={source}", "--json")
    assert out.returncode in (0, 1), out.stderr  # 1: does not fit this machine's defaults, which is a verdict
    result = json.loads(out.stdout)
    assert result["init_from"] == str(source)
    assert result["params"]["total"] == theirs and result["params"]["sparse"] == experts
    assert set(result["budget"]["tiers"]) == {"gpu", "cpu", "ssd"}
    table = run_moesys("plan", "recipe=finetune", f"train.init_from={source}")
    text = " ".join(table.stdout.split())
    assert f"train.init_from={source}" in text
    for tier, formula in (("GPU", "16D + 4aS/L <= M_GPU*N"), ("CPU", "16aS <= M_CPU*N"), ("SSD", "12S <= M_SSD*N")):
        assert f"{tier} │ {formula}" in text, text
