"""Expert + data parallel training on 2 gloo processes against single-process training on the same global batch."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from runtime.config import MoesysConfig, config_from_dict
from runtime.parallel.groups import build_groups
from runtime.train.build import build_components
from runtime.train.loop import forward_backward
from tests.distributed.torchrun import torchrun

WORKER = Path(__file__).with_name("_worker_train.py")


def small_config(world: int, ep: int, **model) -> MoesysConfig:
    cfg = MoesysConfig()
    cfg.model = dataclasses.replace(cfg.model, hidden_size=32, num_layers=2, num_heads=2, ffn_hidden_size=64,
                                    num_experts=4, top_k=2, max_seq_len=32, aux_loss_weight=0.0, **model)
    cfg.topology = dataclasses.replace(cfg.topology, nproc_per_node=world, expert_parallel=ep)
    cfg.train = dataclasses.replace(cfg.train, micro_batch_size=2 * 2 // world, seq_len=16)
    return config_from_dict(dataclasses.asdict(cfg))


def run_workers(tmp_path: Path, mode: str, cfg: MoesysConfig, nproc: int) -> list[dict]:
    cfg_file = tmp_path / "cfg.json"
    cfg_file.write_text(json.dumps(dataclasses.asdict(cfg)))
    proc = torchrun(nproc, WORKER, mode, str(cfg_file), str(tmp_path), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]


def single_process_grads(cfg: MoesysConfig) -> tuple[float, dict[str, torch.Tensor]]:
    groups = build_groups(1, 0, 1, 1)
    c = build_components(cfg, groups, torch.device("cpu"))
    loss, _ = forward_backward(c, cfg, groups, 0, torch.device("cpu"))
    grads = {}
    for name, p in c.model.named_parameters():
        if name.endswith(("experts.w1", "experts.w2", "experts.w3", "experts.b1", "experts.b2", "experts.b3")):
            grads.update({f"{name}.{g}": p.grad[g] for g in range(p.shape[0])})
        else:
            grads[name] = p.grad
    return float(loss), grads


@pytest.mark.parametrize("expert_type", ["gelu", "swiglu"])
def test_expert_parallel_matches_single_process(tmp_path, expert_type):
    dist_cfg = small_config(world=2, ep=2, expert_type=expert_type)
    reports = run_workers(tmp_path, "grads", dist_cfg, 2)
    ref_loss, ref_grads = single_process_grads(
        dataclasses.replace(dist_cfg, topology=dataclasses.replace(dist_cfg.topology, nproc_per_node=1,
                                                                   expert_parallel=1),
                            train=dataclasses.replace(dist_cfg.train, micro_batch_size=4)))
    assert sum(r["loss"] for r in reports) / 2 == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
    grads = {**load_file(str(tmp_path / "grads-rank0.safetensors")),
             **load_file(str(tmp_path / "grads-rank1.safetensors"))}
    assert set(grads) == set(ref_grads)
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=1e-4, atol=1e-6, msg=name)


def test_expert_with_no_tokens_and_rank_sending_nothing(tmp_path):
    """Every token goes to experts 0 and 1 (EP rank 0): EP rank 1 gets no rows, no rank sends it any."""
    cfg = small_config(world=2, ep=2)
    reports = run_workers(tmp_path, "zero_tokens", cfg, 2)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in reports)
    grads = {**load_file(str(tmp_path / "grads-rank0.safetensors")),
             **load_file(str(tmp_path / "grads-rank1.safetensors"))}
    idle = [k for k in grads if k.rsplit(".", 1)[-1] in ("2", "3") and ".experts." in k]
    busy = [k for k in grads if k.rsplit(".", 1)[-1] == "0" and ".experts.w1" in k]
    assert idle and all(torch.count_nonzero(grads[k]) == 0 for k in idle)
    assert busy and all(torch.count_nonzero(grads[k]) > 0 for k in busy)
    for layer in reports[0]["loads"]:
        assert layer[2] == layer[3] == 0.0
