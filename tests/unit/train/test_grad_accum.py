"""train.grad_accum_steps: micro-batches whose gradients add up equal the single large batch (fp32, dropless, no
router loss) within fp32 rounding, resident and offloaded; offloaded experts' gradients go home and the host
optimizer runs once an optimizer step, however many micro-batches; metrics and checkpoints count optimizer steps."""

from __future__ import annotations

import pytest
import torch

from runtime.config import ModelConfig, MoesysConfig, StorageConfig, TopologyConfig, TrainConfig
from runtime.files.run_dir import read_metrics
from runtime.parallel.groups import build_groups
from runtime.train.build import build_components
from runtime.train.checkpoint import latest_checkpoint
from runtime.train.loop import forward_backward, optimizer_step, train

CPU = torch.device("cpu")
STEPS = 3


def config(run_dir, micro: int, accum: int, offload: str = "none", delayed: bool = False, **model) -> MoesysConfig:
    m = ModelConfig(hidden_size=32, num_layers=2, num_heads=2, ffn_hidden_size=64, num_experts=4, top_k=2,
                    max_seq_len=32, aux_loss_weight=0.0, bias=False, **model)  # no key bias: its gradient is 0 but
    # for rounding, which AdamW's first steps blow up to +-lr whatever its size
    return MoesysConfig(model=m, topology=TopologyConfig(nproc_per_node=1, expert_parallel=1),
                        storage=StorageConfig(offload=offload, delayed_update=delayed),
                        train=TrainConfig(seq_len=16, micro_batch_size=micro, grad_accum_steps=accum, warmup_steps=1,
                                          lr=1e-3, run_dir=str(run_dir)))


def expert_masters(c) -> dict:
    """Every expert's fp32 weights by (layer, expert): from the engine's home when offloaded, else the model."""
    if c.offload is None:
        return {(i, e): torch.cat([w[e].reshape(-1) for n, w in layer.experts.weights().items() if w is not None])
                for i, layer in enumerate(c.model.moe_layers()) for e in range(4)}
    return {(i, e): c.offload.home.checkpoint_slot((i, e)).master.clone() for i in range(2) for e in range(4)}


def run(cfg: MoesysConfig) -> dict:
    groups = build_groups(1, 0, 1, 1)
    c = build_components(cfg, groups, CPU)
    losses, grads, per_step = [], None, []
    for step in range(STEPS):
        loss, _ = forward_backward(c, cfg, groups, step, CPU)
        if step == 0:
            grads = {n: p.grad.clone() for n, p in c.model.named_parameters() if p.grad is not None}
        optimizer_step(c, cfg, groups, step)
        losses.append(float(loss))
        if c.offload:
            per_step.append(c.offload.step_metrics())
    if c.offload:
        c.offload.drain()
    out = {"losses": losses, "grads": grads, "metrics": per_step, "experts": expert_masters(c),
           "dense": {n: p.detach().clone() for n, p in c.model.named_parameters()},
           "calls": dict(c.offload.optimizer.calls) if c.offload else {},
           "sent": c.offload.transfers.grads_sent if c.offload else 0}
    for part in c.parts:
        part.close()
    return out


@pytest.mark.parametrize("offload,delayed", [("none", False), ("cpu", False), ("cpu", True), ("ssd", False)])
def test_micro_batches_equal_the_large_batch(tmp_path, offload, delayed):
    large = run(config(tmp_path / "large", 8, 1, offload, delayed))
    accum = run(config(tmp_path / "accum", 2, 4, offload, delayed))
    assert accum["losses"] == pytest.approx(large["losses"], rel=1e-6, abs=1e-6)
    for name, grad in large["grads"].items():  # the first step's gradients, before clipping and AdamW
        torch.testing.assert_close(accum["grads"][name], grad, rtol=1e-6, atol=1e-6, msg=name)
    for name, p in large["dense"].items():
        torch.testing.assert_close(accum["dense"][name], p, rtol=1e-6, atol=1e-6, msg=name)
    for key, w in large["experts"].items():
        torch.testing.assert_close(accum["experts"][key], w, rtol=1e-6, atol=1e-6, msg=str(key))


def test_offloaded_gradients_go_home_and_are_stepped_once_a_step(tmp_path):
    accum = run(config(tmp_path / "accum", 2, 4, "cpu"))
    once = run(config(tmp_path / "once", 2, 1, "cpu"))
    layers = 2
    assert accum["calls"] == {"take_in": STEPS * layers, "submit": STEPS}  # not once a micro-batch
    assert accum["sent"] == STEPS * layers
    slot_bytes = 4 * sum(t.numel() for t in accum["experts"].values()) // layers  # one layer's every expert, fp32
    for m in accum["metrics"]:
        assert 0 < m["offload/grad_home_bytes"] <= layers * slot_bytes * 1.1  # padding at most
        assert m["offload/experts_active"] <= layers * 4  # the union of the micro-batches' experts, counted once
    # four micro-batches send no more than one does: what crossed is each layer's sum
    assert sum(m["offload/grad_home_bytes"] for m in accum["metrics"]) <= 1.1 * sum(
        m["offload/grad_home_bytes"] for m in once["metrics"])


def test_metrics_lr_and_checkpoints_count_optimizer_steps(tmp_path):
    cfg = config(tmp_path, 2, 3)
    cfg.train.max_steps, cfg.train.checkpoint_every = 4, 2
    summary = train(cfg, tmp_path, build_groups(1, 0, 1, 1), CPU)
    lines = read_metrics(tmp_path)
    assert summary["steps"] == 4 and [m["step"] for m in lines] == [1, 2, 3, 4]
    assert latest_checkpoint(tmp_path).name.endswith("4")
    assert lines[0]["tokens_per_s"] == pytest.approx(2 * 3 * 16 / lines[0]["step_time_s"])  # every micro-batch's
    assert lines[0]["lr"] == pytest.approx(cfg.train.lr)  # step 1 of the warm-up of 1 step: its peak
