"""bf16 / fp16 compute with fp32 master weights (fp16 with loss scaling), against fp32 training on CPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from runtime.config import MoesysConfig, config_from_dict
from runtime.parallel.groups import build_groups
from runtime.train.build import build_components
from runtime.train.loop import forward_backward, optimizer_step
from runtime.train.loss_scale import DynamicLossScale

CPU = torch.device("cpu")


def losses(precision: str, steps: int = 3, device: torch.device = CPU, offload: str = "none",
           run_dir=None, resident_layers: int = 0, delayed_update: bool = False) -> tuple[list[float], torch.dtype]:
    """Losses of a few steps of a small model (2 MoE layers) at `precision`, and the dtype of its (master)
    parameters."""
    cfg = MoesysConfig()
    cfg.model = dataclasses.replace(cfg.model, hidden_size=64, num_layers=2, ffn_hidden_size=128)
    cfg.topology = dataclasses.replace(cfg.topology, nproc_per_node=1, expert_parallel=1)
    cfg.train = dataclasses.replace(cfg.train, micro_batch_size=2, seq_len=32, precision=precision,
                                    run_dir=str(run_dir) if run_dir else None)
    cfg.storage = dataclasses.replace(cfg.storage, offload=offload, resident_layers=resident_layers,
                                      delayed_update=delayed_update)
    cfg = config_from_dict(dataclasses.asdict(cfg))
    groups = build_groups(1, 0, 1, 1)
    c = build_components(cfg, groups, device)
    scaler = DynamicLossScale() if precision == "fp16" else None
    out = []
    for step in range(steps):
        loss, _ = forward_backward(c, cfg, groups, step, device, scaler)
        optimizer_step(c, cfg, groups, step, scaler)
        out.append(float(loss))
    for part in c.parts:
        part.close()
    return out, {p.dtype for p in c.model.parameters()}.pop()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_compute_tracks_fp32_with_fp32_master_weights(precision):
    ref, _ = losses("fp32")
    half, master = losses(precision)
    assert master == torch.float32
    assert half != ref  # the compute really ran in half precision
    assert half == pytest.approx(ref, rel=2e-2)


@pytest.mark.parametrize("offload,resident_layers", [("cpu", 0), ("ssd", 0), ("cpu", 1)])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_with_offloaded_experts_tracks_resident(tmp_path, precision, offload, resident_layers):
    """The paper's GPT-MoE recipes train in fp16 with loss scaling: offloaded experts copy to the device in the
    compute dtype, and their CPU optimizer unscales inside the kernel (beside a layer kept on the device)."""
    ref, _ = losses(precision)
    got, _ = losses(precision, offload=offload, run_dir=tmp_path, resident_layers=resident_layers)
    assert got == pytest.approx(ref, rel=1e-3)
