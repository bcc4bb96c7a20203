"""Building without materializing: each rank allocates only its own part, experts are created straight into their
tier, and initial weights depend on (seed, name, global expert) only, so expert g is the same for any
expert-parallel size and any tier."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from runtime.config import ModelConfig, MoesysConfig, StorageConfig, TrainConfig
from runtime.host.memory_probe import PeakMemory
from runtime.plan.params import count_parameters
from runtime.model.transformer import Transformer
from runtime.moe.layer import is_expert_param
from runtime.parallel.groups import build_groups
from runtime.train.build import build_components
from tests.builders import build_model

CPU = torch.device("cpu")


def config(**model) -> MoesysConfig:
    m = dict(hidden_size=32, num_layers=2, num_heads=2, num_experts=4, top_k=2, max_seq_len=32) | model
    return MoesysConfig(model=ModelConfig(**m), train=TrainConfig(seq_len=16, micro_batch_size=2, seed=5))


def ep_groups(ep: int, rank: int):
    """What build_groups gives expert-parallel rank `rank` of `ep`, without process groups (nothing here talks)."""
    return dataclasses.replace(build_groups(1, 0, 1, 1), ep_size=ep, ep_rank=rank)


def experts_by_global_index(model, first: int) -> dict[tuple[str, int], torch.Tensor]:
    out = {}
    for name, param in model.named_parameters():
        if is_expert_param(name):
            for j in range(param.shape[0]):
                out[name, first + j] = param.detach()[j]
    return out


def test_expert_g_is_the_same_for_every_expert_parallel_size():
    cfg = config()
    full = build_model(cfg, ep_groups(1, 0), CPU)
    want = experts_by_global_index(full, 0)
    dense = {n: p for n, p in full.named_parameters() if not is_expert_param(n)}
    for ep in (2, 4):
        for rank in range(ep):
            model = build_model(cfg, ep_groups(ep, rank), CPU)
            local = cfg.model.num_experts // ep
            got = experts_by_global_index(model, rank * local)
            assert len(got) == len(want) // ep
            for key, tensor in got.items():
                assert torch.equal(tensor, want[key]), key
            for name, param in model.named_parameters():
                if not is_expert_param(name):
                    assert torch.equal(param, dense[name]), name


def test_a_seeded_transformer_equals_the_built_model_and_seeds_differ():
    cfg = config()
    built = build_model(cfg, ep_groups(1, 0), CPU)
    same = Transformer(cfg.model, seed=cfg.train.seed)
    other = Transformer(cfg.model, seed=cfg.train.seed + 1)
    for (name, a), b, c in zip(built.named_parameters(), same.parameters(), other.parameters()):
        assert torch.equal(a, b), name
        if a.dim() >= 2 and a.std() > 0:
            assert not torch.equal(a, c), name
    w = built.tok_embeddings.weight
    assert abs(float(w.detach().std()) - 0.02) < 0.002  # GPT-2 init kept


@pytest.mark.parametrize("offload", ["cpu", "ssd"])
def test_offloaded_experts_are_created_in_the_store_equal_to_resident(tmp_path, offload):
    cfg = config()
    cfg = dataclasses.replace(cfg, storage=StorageConfig(offload=offload, ssd_path=str(tmp_path / "store")),
                              train=dataclasses.replace(cfg.train, run_dir=str(tmp_path / "run")))
    resident = experts_by_global_index(build_model(config(), ep_groups(1, 0), CPU), 0)
    for ep in (1, 2):
        for rank in range(ep):
            c = build_components(cfg, ep_groups(ep, rank), CPU)
            assert not c.expert_params  # nothing resident
            for spec in c.offload.specs.values():
                for j in range(spec.num_local):
                    key = spec.key(j)
                    slot = c.offload.home.checkpoint_slot(key)  # from the store (ssd) or host memory (cpu)
                    for n, weight in slot.views("master", spec.layout).items():
                        assert torch.equal(weight, resident[f"{spec.param_prefix}.{n}", key[1]])
                    assert not slot.exp_avg.any()
            assert (tmp_path / "store").exists() == (offload == "ssd")  # storage=cpu writes no store
            c.offload.close()


def test_an_offloaded_build_never_holds_the_experts_in_memory(tmp_path):
    """~600 MB of expert weights (1.8 GB of states): building with offload=ssd grows by one expert's states in flight
    plus a constant (allocator, dense part; 100-200 MB measured, whatever the expert count), where a build that
    materializes the model first holds every expert's weights at least once."""
    cfg = config(hidden_size=256, ffn_hidden_size=4096, num_layers=2, num_experts=36, vocab_size=256)
    cfg = dataclasses.replace(cfg, storage=StorageConfig(offload="ssd", ssd_path=str(tmp_path / "store")),
                              train=dataclasses.replace(cfg.train, run_dir=str(tmp_path / "run")))
    expert_weights = 4 * count_parameters(cfg.model).sparse
    with PeakMemory(interval_s=0.005) as peak:
        base = peak.sample()
        c = build_components(cfg, ep_groups(1, 0), CPU)
    grew = peak.peak - base
    c.offload.close()
    assert expert_weights > 500 * 2**20
    assert grew < expert_weights / 2, (grew >> 20, expert_weights >> 20)
