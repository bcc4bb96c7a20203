"""Multi-task training on gloo processes: gradients equal one process hosting every task, and a checkpoint
written by one allocation loads exactly into another (other world size, expert-parallel size and packing)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from runtime.config import MoesysConfig, TaskConfig, config_from_dict
from runtime.parallel.groups import build_groups
from runtime.train.build import build_components
from runtime.train.loop import forward_backward
from tests.distributed.test_multitask_worker import by_global_name
from tests.distributed.torchrun import torchrun

WORKER = Path(__file__).with_name("test_multitask_worker.py")


def config(world: int, ep: int, gpus: tuple[int, int, int]) -> MoesysConfig:
    """Tasks a (4 samples), b and c (2 each); six experts so that 1, 2 and 3 expert-parallel ranks divide them."""
    cfg = MoesysConfig()
    cfg.model = dataclasses.replace(cfg.model, hidden_size=32, num_layers=2, num_heads=2, ffn_hidden_size=64,
                                    num_experts=6, top_k=2, max_seq_len=32, aux_loss_weight=0.0)
    cfg.topology = dataclasses.replace(cfg.topology, nproc_per_node=world, expert_parallel=ep)
    cfg.train = dataclasses.replace(cfg.train, seq_len=16, warmup_steps=1, max_steps=2, checkpoint_every=0)
    cfg.tasks = {name: TaskConfig(batch_size=b, gpus=g) for name, b, g in zip("abc", (4, 2, 2), gpus)}
    return config_from_dict(dataclasses.asdict(cfg))


def run(tmp_path: Path, mode: str, cfg: MoesysConfig, out: Path) -> None:
    cfg_file = tmp_path / f"cfg-{mode}.json"
    cfg_file.write_text(json.dumps(dataclasses.asdict(cfg)))
    out.mkdir(exist_ok=True)
    proc = torchrun(cfg.topology.nproc_per_node, WORKER, mode, str(cfg_file), str(out), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def merged(out: Path, prefix: str, world: int) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for r in range(world):
        for key, value in load_file(str(out / f"{prefix}-rank{r}.safetensors")).items():
            if key in tensors:  # a head on several ranks: every copy must be the same
                torch.testing.assert_close(value, tensors[key], rtol=0, atol=0, msg=key)
            tensors[key] = value
    return tensors


def test_three_ranks_with_a_split_task_and_a_packed_rank_match_one_process(tmp_path):
    cfg = config(world=3, ep=3, gpus=(2, 1, 1))  # a on ranks 0-1 (2 samples each); b and c packed on rank 2
    run(tmp_path, "grads", cfg, tmp_path)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert [r["tasks"] for r in reports] == [["a"], ["a"], ["b", "c"]]

    ref_cfg = config(world=1, ep=1, gpus=(1, 1, 1))
    groups = build_groups(1, 0, 1, 1)
    c = build_components(ref_cfg, groups, torch.device("cpu"))
    ref_loss, _ = forward_backward(c, ref_cfg, groups, 0, torch.device("cpu"))
    ref = by_global_name(c, groups, lambda p: p.grad)

    assert sum(r["loss"] for r in reports) / 3 == pytest.approx(float(ref_loss), rel=1e-5)
    grads = merged(tmp_path, "grads", 3)
    assert set(grads) == set(ref) and {"task_heads.a.weight", "task_heads.c.weight"} <= set(ref)
    for name, value in ref.items():
        torch.testing.assert_close(grads[name], value, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.extended
def test_checkpoint_of_one_allocation_loads_exactly_into_another(tmp_path):
    run_dir = tmp_path / "run"
    run(tmp_path, "train", config(world=3, ep=3, gpus=(2, 1, 1)), run_dir)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rank_lines = [m for m in lines if "rank" in m]
    assert {(m["rank"], m["task"]) for m in rank_lines} == {(0, "a"), (1, "a"), (2, "b"), (2, "c")}
    assert all(m["samples_per_s"] > 0 for m in rank_lines)
    steps = [m for m in lines if "loss" in m]
    assert [m["step"] for m in steps] == [1, 2] and set(steps[-1]["task_loss"]) == {"a", "b", "c"}

    # Now 2 ranks, experts split in 2 instead of 3: a on rank 0, b and c packed on rank 1.
    run(tmp_path, "load", config(world=2, ep=2, gpus=(1, 1, 1)), run_dir)
    loaded = merged(run_dir, "loaded", 2)
    ckpt = run_dir / "checkpoints" / "step_00000002"
    saved: dict[str, torch.Tensor] = {}
    for f in ckpt.glob("*.safetensors"):
        if not f.name.startswith("rng-"):
            saved.update(load_file(str(f)))
    assert sorted(p.name for p in ckpt.glob("heads-*")) == [f"heads-{t}.safetensors" for t in "abc"]
    for key, value in loaded.items():
        kind, name = ("exp_avg", key[len("exp_avg."):]) if key.startswith("exp_avg.") else ("model", key)
        assert torch.equal(value, saved[f"{kind}.{name}"]), key
    heads = {k for k in loaded if k.startswith("task_heads.")}
    assert heads == {f"task_heads.{t}.weight" for t in "abc"}
    assert any(".experts." in k and k.endswith(".5") for k in loaded)  # every global expert came back
