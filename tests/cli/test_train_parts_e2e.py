"""The released families' parts train in moesys's own loop, as a user types it: `moesys train recipe=tiny` (two
torchrun processes, expert parallel 2) with a family's parts set by model.* keys. Offloaded storage treats the routed
experts only (shared experts are dense parameters): storage.offload=cpu gives the resident losses. Each trained run
exports in its family's format, and transformers' own model of the export gives moesys's logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.inference.load import load_model
from tests.cli.conftest import FAST_TINY, losses, run_moesys
from tests.hf_families import load_transformers

pytestmark = pytest.mark.slow
STEPS = 8
SWIGLU_ROPE = ["model.expert_type=swiglu", "model.norm=rmsnorm", "model.position=rope", "model.bias=false",
               "model.tie_embeddings=false"]
PARTS = {
    "qwen2_moe": ["model.attention_bias=qkv", "model.shared_expert_hidden_size=64", "model.shared_expert_gate=true",
                  "model.moe_layers=[1,3]", "model.dense_ffn_hidden_size=96", "model.normalize_top_k=false",
                  "model.load_balancing=pooled"],
    "qwen3_moe": ["model.qk_norm=head", "model.head_dim=48", "model.moe_layers=[0,2,3]", "model.load_balancing=pooled"],
    "ernie4_5_moe": ["model.router_score_bias=true", "model.shared_expert_hidden_size=512", "model.moe_layers=[1,2,3]",
                     "model.dense_ffn_hidden_size=96"],
}
IDS = [[60, 61, 62, 63, 70, 71, 72, 104, 101]]


def train(cwd: Path, name: str, family: str, *overrides: str) -> Path:
    run_dir = cwd / "runs" / name
    done = run_moesys("train", *FAST_TINY, f"train.max_steps={STEPS}", f"train.run_dir={run_dir}", *SWIGLU_ROPE,
                      *PARTS[family], f"model.family={family}", *overrides, cwd=cwd, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(losses(run_dir)) == STEPS
    return run_dir


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("parts-e2e")


@pytest.mark.extended
def test_shared_experts_are_dense_under_offloading_and_export_to_qwen2_moe(workdir):
    resident = train(workdir, "qwen2-none", "qwen2_moe")
    offloaded = train(workdir, "qwen2-cpu", "qwen2_moe", "storage.offload=cpu")
    assert losses(offloaded) == pytest.approx(losses(resident), rel=1e-5)
    assert losses(resident)[-1] < losses(resident)[0]
    check_export(workdir, resident, "qwen2_moe")


@pytest.mark.parametrize("family", ["qwen3_moe", pytest.param("ernie4_5_moe", marks=pytest.mark.extended)])
def test_qk_norms_and_the_score_bias_train_and_export(workdir, family):
    run_dir = train(workdir, family, family)
    assert losses(run_dir)[-1] < losses(run_dir)[0]
    check_export(workdir, run_dir, family)


def check_export(workdir: Path, run_dir: Path, family: str) -> None:
    out = workdir / f"{run_dir.name}-hf"
    done = run_moesys("export", f"checkpoint={run_dir}", f"out={out}", "export.format=hf")
    assert done.returncode == 0, done.stderr[-2000:]
    ours = load_model(run_dir).model
    with torch.no_grad():
        theirs = load_transformers(out)(input_ids=torch.tensor(IDS)).logits
        assert (theirs - ours(torch.tensor(IDS)).logits).abs().max().item() <= 1e-4
    assert load_transformers(out).config.model_type == family
