"""The live store at speed: one write-behind job per layer with updated experts, a reader of a key waits for the
batch that writes it."""

from __future__ import annotations

import time

import torch

from runtime.config import ModelConfig, MoesysConfig, TrainConfig
from runtime.optim import lr_at
from runtime.parallel.groups import build_groups
from runtime.storage.expert_store import ExpertStore
from runtime.storage.offload import install_offload
from runtime.train.build import build_model

CPU = torch.device("cpu")


def offloaded(store: ExpertStore, layers: int = 3, experts: int = 4, cache: int = 0):
    cfg = MoesysConfig(model=ModelConfig(hidden_size=16, ffn_hidden_size=32, num_layers=layers, num_heads=2,
                                         num_experts=experts, top_k=2, max_seq_len=16),
                       train=TrainConfig(seq_len=8, micro_batch_size=2, warmup_steps=1))
    model = build_model(cfg, build_groups(1, 0, 1, 1), CPU)
    mgr = install_offload(model, store, CPU, seed=0, cache_experts=cache,
                          lr_schedule=lambda step: lr_at(step, cfg.train))
    return model, mgr


def forward_backward(model, mgr, experts_of_layer):
    """Route 3 rows of every MoE layer to each expert of `experts_of_layer(layer)` and backpropagate; returns the
    keys of the experts that got gradients."""
    keys = []
    for index, layer in enumerate(model.moe_layers()):
        active = experts_of_layer(index)
        counts = torch.tensor([3 if e in active else 0 for e in range(mgr.specs[index].num_local)])
        layer.experts(torch.randn(int(counts.sum()), 16), counts).square().sum().backward()
        keys += [mgr.specs[index].key(e) for e in active]
    mgr.finish_backward()
    return keys


def test_one_write_job_per_layer_with_updates_and_reads_wait_for_it(tmp_path):
    store = ExpertStore(tmp_path)
    model, mgr = offloaded(store, layers=3)  # nothing cached: every updated expert goes home to SSD
    real_write = store.write

    def slow_write(key, state):  # the batch is still being written when the reader comes
        time.sleep(0.05)
        real_write(key, state)

    store.write = slow_write
    for step, idle_layer in enumerate([None, 1]):
        keys = forward_backward(model, mgr, lambda i: {(i + step) % 4, (i + step + 1) % 4})
        if idle_layer is not None:  # drop one layer's gradients: it has no update this step
            keys = [k for k in keys if k[0] != idle_layer]
            mgr._grads = {k: g for k, g in mgr._grads.items() if k[0] != idle_layer}
            mgr._states = {k: s for k, s in mgr._states.items() if k[0] != idle_layer}
        updated = dict(mgr._states)
        jobs = mgr.writes.jobs
        mgr.step(1e-2)
        mgr.wait_step()
        assert len(keys) == 2 * len({k[0] for k in keys})
        assert mgr.writes.jobs - jobs == len({k[0] for k in keys})  # one job per layer with updated experts
        for key in keys:
            back = mgr._read(key)  # waits for the job writing it
            assert float(back["step"]) == step + 1
            assert all(torch.equal(back[name], updated[key][name]) for name in back)
        mgr._drop_host(back)
    mgr.close()
