"""Dense parameter sharding (the paper's Algorithm 1) in one process: flat layout, prefetch order, freeing, and
training and checkpoints equal to replicated dense states (the 2-process tests are in tests/distributed)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings, strategies as st

from runtime.config import ModelConfig, MoesysConfig, StorageConfig, TrainConfig, config_from_dict
from runtime.model.transformer import Transformer
from runtime.moe.layer import is_expert_param
from runtime.parallel.dense_shard import DenseShard, flat_layout
from runtime.parallel.groups import build_groups
from runtime.train.build import build_components
from runtime.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from runtime.train.loop import forward_backward, optimizer_step

CPU = torch.device("cpu")
MODEL = ModelConfig(hidden_size=32, num_layers=3, num_heads=2, ffn_hidden_size=64, num_experts=4, top_k=2,
                    max_seq_len=32)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.booleans()), min_size=1, max_size=8), st.integers(1, 5))
def test_flat_layout_pads_and_partitions(params, world):
    numels, decay = [n for n, _ in params], [d for _, d in params]
    layout, order = flat_layout(numels, decay, world)
    total = sum(numels)
    assert layout.padded % world == 0 and total <= layout.padded < total + world
    spans = sorted((layout.offsets[i], layout.offsets[i] + numels[i], decay[i]) for i in range(len(numels)))
    assert [a for a, _, _ in spans] == [0] + [b for _, b, _ in spans[:-1]]  # contiguous, no overlap
    assert all(d for a, b, d in spans if b <= layout.decay_numel) and not any(d for a, _, d in spans
                                                                             if a >= layout.decay_numel)
    covered = []
    for rank in range(world):
        for a, b, d in layout.shard_ranges(rank):
            lo = rank * layout.shard
            covered += [(x, d) for x in range(lo + a, lo + b)]
    assert covered == [(x, x < layout.decay_numel) for x in range(layout.padded)]


def config(dense_shard: bool) -> MoesysConfig:
    cfg = MoesysConfig(model=MODEL, storage=StorageConfig(dense_shard=dense_shard),
                       train=TrainConfig(seq_len=16, micro_batch_size=2, warmup_steps=1, grad_clip=0.0))
    cfg.topology = dataclasses.replace(cfg.topology, nproc_per_node=1, expert_parallel=1)
    return config_from_dict(dataclasses.asdict(cfg))


def train(dense_shard: bool, steps: int):
    cfg, groups = config(dense_shard), build_groups(1, 0, 1, 1)
    c = build_components(cfg, groups, CPU)
    torch.manual_seed(7)
    losses = []
    for step in range(steps):
        loss, _ = forward_backward(c, cfg, groups, step, CPU)
        optimizer_step(c, cfg, groups, step)
        losses.append(float(loss))
    return c, cfg, groups, losses


def test_one_rank_trains_bitwise_like_replicated_and_holds_empty_dense_params():
    ref, _, _, ref_losses = train(False, 3)
    c, _, _, losses = train(True, 3)
    assert losses == ref_losses  # no clipping, one rank: the same elementwise AdamW on the same gradients
    full = c.dense_shard.full_state(c.optimizer)
    for name, p in ref.model.named_parameters():
        if is_expert_param(name):
            continue
        assert torch.equal(full[name]["model"], p.detach()), name
        assert torch.equal(full[name]["exp_avg_sq"], ref.optimizer.state[p]["exp_avg_sq"]), name
        assert dict(c.model.named_parameters())[name].numel() == 0  # freed between steps
    assert c.dense_shard.gathered_bytes == 0


@pytest.mark.parametrize("write_sharded", [True, False])
def test_checkpoint_loads_across_dense_shard_settings(tmp_path, write_sharded):
    writer, cfg, groups, _ = train(write_sharded, 2)
    save_checkpoint(tmp_path, 2, writer.model, writer.optimizer, groups, cfg, parts=writer.parts)
    reader = build_components(config(not write_sharded), groups, CPU)
    assert load_checkpoint(latest_checkpoint(tmp_path), reader.model, reader.optimizer, groups,
                           parts=reader.parts) == 2
    sharded, plain = (writer, reader) if write_sharded else (reader, writer)
    full = sharded.dense_shard.full_state(sharded.optimizer)
    for name, p in plain.model.named_parameters():
        if not is_expert_param(name):
            assert torch.equal(full[name]["model"], p.detach()), name
            assert torch.equal(full[name]["exp_avg"], plain.optimizer.state[p]["exp_avg"]), name
            assert float(full[name]["step"]) == float(plain.optimizer.state[p]["step"]) == 2


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_blocks_are_gathered_depth_layers_ahead(depth):
    torch.manual_seed(0)
    model = Transformer(MODEL)
    dense = [p for n, p in model.named_parameters() if not is_expert_param(n)]
    shard = DenseShard(model, dense, None, prefetch_depth=depth)
    seen = []

    def record(k, module, args):  # runs after the shard's own pre-hook of block k
        seen.append([u.materialized or u.gather_work is not None for u in shard.blocks])

    for k, block in enumerate(model.layers):
        block.register_forward_pre_hook(lambda m, a, k=k: record(k, m, a))
    with torch.no_grad():
        model(torch.randint(0, MODEL.vocab_size, (1, 8)))
    n = len(model.layers)
    assert seen == [[j <= k + depth for j in range(n)] for k in range(n)]
    assert shard.gathered_bytes == 0  # a forward without grad frees what it gathered
    assert all(p.numel() == 0 for p in dense)
