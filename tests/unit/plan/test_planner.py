"""Plans that do not fit: a plan never raises, its search stays small, it judges serving recipes by serving, and
it never asks to lower what is already at its minimum."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from runtime.config import InferConfig, ModelConfig, MoesysConfig, StorageConfig, TopologyConfig, TrainConfig
from runtime.plan import planner
from runtime.plan.budget import GB, eq1_budget
from runtime.plan.planner import plan_placement, plan_to_dict
from runtime.plan.suggest import first_passing, node_counts

MIXTRAL = ModelConfig(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, vocab_size=32000,
                      ffn_hidden_size=14336, num_experts=8, top_k=2, expert_type="swiglu", max_seq_len=32768,
                      norm="rmsnorm", bias=False, position="rope", tie_embeddings=False)


def tiny(**topology) -> MoesysConfig:
    topo = dict(nodes=1, gpus_per_node=0, cpu_memory_gb=16, ssd_gb=100, expert_parallel=8, nproc_per_node=8)
    topo.update(topology)
    return MoesysConfig(topology=TopologyConfig(**topo))


def mixtral_on_one_gpu(purpose: str, **train) -> MoesysConfig:
    topo = TopologyConfig(nodes=1, gpus_per_node=1, gpu_memory_gb=80, cpu_memory_gb=1024, ssd_gb=15000,
                          expert_parallel=1, nproc_per_node=1)
    tr = TrainConfig(**{"micro_batch_size": 1, "seq_len": 4096, "precision": "bf16", **train})
    return MoesysConfig(model=MIXTRAL, topology=topo, storage=StorageConfig(offload="auto"), train=tr,
                        purpose=purpose)


@pytest.mark.parametrize("topology", [dict(gpus_per_node=8), dict(gpus_per_node=8, ssd_gb=0),
                                      dict(cpu_memory_gb=0), dict(ssd_gb=0, cpu_memory_gb=0.001)])
def test_a_tier_with_no_capacity_is_named_and_the_plan_never_raises(topology):
    plan = plan_placement(tiny(**topology))  # gpus_per_node=8 with gpu_memory_gb=0: no GPU tier at any size
    data = json.loads(json.dumps(plan_to_dict(plan), allow_nan=False))
    assert not plan.feasible and plan.suggestions
    dead = data["budget"]["unsatisfiable"]
    assert dead and data["budget"]["min_nodes"] is None
    for tier in dead:
        assert f"Eq. 1 {tier.upper()} tier holds at no node count" in plan.suggestions[-1]
    assert "=" not in plan.suggestions[-1]


def test_min_nodes_of_an_empty_requirement_is_one():
    cfg = tiny(ssd_gb=0)
    p = planner.count_parameters(cfg.model)
    budget = eq1_budget(cfg, dataclasses.replace(p, sparse=0))
    assert budget.ssd.nodes_needed(1) == 1 and "ssd" not in budget.unsatisfiable()


def test_the_suggestion_search_is_bounded_for_a_huge_model(monkeypatch):
    calls = []
    estimate = planner._rank_estimate

    def counted(*args):
        calls.append(args)
        assert len(calls) < 300, "the search estimates once per node count (millions of them)"
        return estimate(*args)

    monkeypatch.setattr(planner, "_rank_estimate", counted)
    cfg = tiny(expert_parallel=2, nproc_per_node=2)
    cfg.model = dataclasses.replace(cfg.model, hidden_size=10_000_000)
    plan = plan_placement(cfg)
    assert not plan.feasible and plan.suggestions


def test_more_nodes_are_found_by_bisection_and_fit():
    """Sharded dense states shrink with the world size: a 1 GB GPU needs 16 nodes here (far past the first few)."""
    cfg = tiny(gpus_per_node=2, gpu_memory_gb=1.0, cpu_memory_gb=64, expert_parallel=2, nproc_per_node=2)
    cfg.model = ModelConfig(num_experts=64, hidden_size=1024, ffn_hidden_size=1024, num_layers=8, num_heads=8,
                            vocab_size=50000)
    cfg.train = dataclasses.replace(cfg.train, micro_batch_size=1, seq_len=16)
    cfg.storage = StorageConfig(offload="none", dense_shard=True)
    plan = plan_placement(cfg)
    line = next(s for s in plan.suggestions if s.startswith("topology.nodes="))
    keys = dict(k.split("=") for k in line.split() if "=" in k)
    nodes, ep = int(keys["topology.nodes"]), int(keys["topology.expert_parallel"])
    assert nodes > 8

    def at(n: int) -> MoesysConfig:
        return dataclasses.replace(cfg, topology=dataclasses.replace(cfg.topology, nodes=n, expert_parallel=ep),
                                   storage=dataclasses.replace(cfg.storage, offload=keys["storage.offload"]))

    assert plan_placement(at(nodes)).feasible
    for n in range(1, nodes):  # no fewer nodes fit, in any mode and with any expert-parallel size that is valid there
        for e in (e for e in (2, 4, 8, 16, 32, 64) if 2 * n % e == 0):
            for mode in ("none", "cpu", "ssd"):
                trial = dataclasses.replace(cfg, topology=dataclasses.replace(cfg.topology, nodes=n, expert_parallel=e),
                                            storage=dataclasses.replace(cfg.storage, offload=mode))
                assert not plan_placement(trial).feasible, (n, e, mode)


def test_node_counts_keep_expert_parallel_dividing_the_world():
    cfg = tiny(nodes=1, expert_parallel=4, nproc_per_node=2)
    assert list(node_counts(cfg)[:3]) == [2, 4, 6]
    cfg.model = dataclasses.replace(cfg.model, hidden_size=96, embedding_partition=True)
    assert list(node_counts(cfg)) == [2, 4, 6, 8, 12, 16, 24, 48]  # 2 x nodes divides 96
    assert first_passing([], lambda n: True) is None
    assert first_passing(range(10), lambda n: n >= 7) == 7


def test_no_suggestion_lowers_a_micro_batch_already_at_one():
    plan = plan_placement(mixtral_on_one_gpu("train", seq_len=8192))  # activations no node count makes room for
    assert not plan.feasible
    assert not any("micro_batch_size" in s or "micro-batch" in s.split(":")[-1] for s in plan.suggestions)
    seq = int(plan.suggestions[0].split("train.seq_len=")[1].split()[0])
    assert 1 <= seq < 8192
    assert plan_placement(mixtral_on_one_gpu("train", seq_len=seq)).feasible


def test_a_smaller_micro_batch_is_suggested_when_it_fits():
    plan = plan_placement(mixtral_on_one_gpu("train", seq_len=512, micro_batch_size=16))
    assert plan.suggestions[0].startswith("train.micro_batch_size=")
    batch = int(plan.suggestions[0].split("=")[1].split()[0])
    assert plan_placement(mixtral_on_one_gpu("train", seq_len=512, micro_batch_size=batch)).feasible
    assert not plan_placement(mixtral_on_one_gpu("train", seq_len=512, micro_batch_size=batch + 1)).feasible


def test_a_serving_recipe_is_judged_by_its_inference_budget():
    plan = plan_placement(mixtral_on_one_gpu("serve"))
    inf = plan.inference
    assert plan.feasible and plan.purpose == "serve" and plan.training_problems  # training would not fit
    assert inf["required_bytes"] == inf["dense_bytes"] + 2 * inf["expert_layer_bytes"] <= 80 * GB
    data = plan_to_dict(plan)
    assert data["purpose"] == "serve" and data["training"]["feasible"] is False


@pytest.mark.parametrize("infer,suggestion", [
    (dict(offload="none"), "infer.offload=auto with infer.ring_slots=27 fits"),
    (dict(ring_slots=30), "infer.ring_slots=27 fits"),
    (dict(ring_slots=40), "infer.ring_slots=27 fits"),
])
def test_serving_that_does_not_fit_suggests_the_largest_ring(infer, suggestion):
    cfg = dataclasses.replace(mixtral_on_one_gpu("serve"), infer=InferConfig(**infer))
    plan = plan_placement(cfg)
    assert not plan.feasible and plan.suggestions == [suggestion]


def test_serving_a_model_whose_dense_weights_do_not_fit_says_why():
    cfg = mixtral_on_one_gpu("serve")
    cfg.topology.gpu_memory_gb = 4
    plan = plan_placement(cfg)
    assert not plan.feasible and plan.suggestions[0].startswith("no ring size fits")
    assert "=" not in plan.suggestions[0]


def test_more_nodes_may_split_the_experts_over_more_ranks():
    # a Table 1 model (128 experts) on one node of 8 GPUs: more nodes only help with more expert-parallel ranks
    model = ModelConfig(hidden_size=4096, num_layers=12, num_heads=64, vocab_size=50304, num_experts=128, top_k=1,
                        max_seq_len=1024)
    topo = TopologyConfig(nodes=1, gpus_per_node=8, gpu_memory_gb=80, cpu_memory_gb=1, ssd_gb=0,
                          expert_parallel=8, nproc_per_node=8)  # no room to offload experts to
    cfg = MoesysConfig(model=model, topology=topo, train=TrainConfig(micro_batch_size=1, seq_len=1024))
    plan = plan_placement(cfg)
    assert not plan.feasible
    line = plan.suggestions[-1]
    nodes, ep = (int(line.split(key)[1].split()[0]) for key in ("topology.nodes=", "topology.expert_parallel="))
    assert ep > 8 and 128 % ep == 0 and (nodes * 8) % ep == 0
    wider = dataclasses.replace(topo, nodes=nodes, expert_parallel=ep)
    assert plan_placement(dataclasses.replace(cfg, topology=wider)).feasible


def test_without_a_gpu_the_device_pool_and_the_host_cache_share_one_rams_budget():
    """Each fits half of a rank's RAM on its own; together they do not (the plan counted the RAM twice)."""
    from runtime.config import ModelConfig, MoesysConfig
    from runtime.plan.budget import GB
    from runtime.plan.planner import LAUNCHER_BYTES, PROCESS_RUNTIME_BYTES, plan_placement

    cfg = MoesysConfig(model=ModelConfig(hidden_size=256, ffn_hidden_size=1024, num_layers=4, num_heads=4,
                                         num_experts=8))
    cfg.topology.gpus_per_node, cfg.topology.nproc_per_node, cfg.topology.expert_parallel = 0, 2, 2
    cfg.storage.offload, cfg.train.micro_batch_size, cfg.train.seq_len = "cpu", 1, 64
    r = plan_placement(cfg).per_rank
    ram = r.device_total + r.host
    # 2 ranks: the launcher's share, then each its process runtime and 80% of what its states need for both
    cfg.topology.cpu_memory_gb = (LAUNCHER_BYTES + 2 * (0.8 * ram + PROCESS_RUNTIME_BYTES)) / GB
    r = plan_placement(cfg).per_rank
    assert r.device_total < 0.8 * ram and r.host < 0.8 * ram  # either alone would fit its share
    assert not r.ok
    assert abs(r.device_capacity + r.host - 0.8 * ram) <= 1 and abs(r.host_capacity + r.device_total - 0.8 * ram) <= 1
    cfg.topology.cpu_memory_gb = (LAUNCHER_BYTES + 2 * (1.01 * ram + PROCESS_RUNTIME_BYTES)) / GB
    assert plan_placement(cfg).per_rank.ok


def test_without_a_gpu_a_host_cache_beyond_the_ram_leaves_the_device_pool_nothing_not_less():
    """A host cache larger than the rank's RAM showed the device pool's capacity as -3.95 GB."""
    cfg = MoesysConfig(model=ModelConfig(hidden_size=512, ffn_hidden_size=4096, num_layers=4, num_heads=4,
                                         num_experts=64), topology=TopologyConfig(cpu_memory_gb=10.74),
                       storage=StorageConfig(offload="cpu"))
    plan = plan_placement(cfg)
    r = plan.per_rank
    assert r.host > r.ram_share and r.device_capacity == 0 and r.host_capacity == r.ram_share - r.device_total
    (problem,) = plan.training_problems
    assert problem.startswith("per-rank RAM ") and not re.search(r"-\d", problem)
    assert f"> {r.ram_share / GB:.2f} GB" in problem


def test_layers_kept_on_the_device_move_their_expert_states_from_the_host_to_the_device():
    """storage.resident_layers: each kept layer's experts cost 16 bytes a parameter on the device (Eq. 1's dense
    term) and nothing on the host; too many for the GPU is a plan that does not fit, saying where."""
    def plan(resident_layers: int):
        cfg = mixtral_on_one_gpu("train")
        cfg.storage = StorageConfig(offload="cpu", resident_layers=resident_layers)
        return plan_placement(cfg)

    offloaded, kept, too_many = plan(0), plan(1), plan(8)
    layer = 16 * MIXTRAL.num_experts * offloaded.params.per_expert
    assert kept.per_rank.device["expert_states"] == layer and "expert_states" not in offloaded.per_rank.device
    assert offloaded.per_rank.host - kept.per_rank.host == layer
    assert (offloaded.per_rank.local_experts, kept.per_rank.local_experts) == (32 * 8, 31 * 8)
    assert kept.budget.gpu.formula.startswith("16(D + S_r)")
    assert kept.budget.gpu.required_bytes > offloaded.budget.gpu.required_bytes + layer * 0.99
    assert plan_to_dict(kept)["placement"]["resident_layers"] == 1
    assert not too_many.feasible and any("device memory" in p for p in too_many.problems)


@pytest.mark.parametrize("precision, slot, grad", [("fp32", 12, 4), ("bf16", 14, 2)])
def test_host_bytes_of_an_offloaded_parameter_follow_its_slot_and_gradients(precision, slot, grad):
    """An offloaded expert's slot holds fp32 master and moments (12 bytes a parameter) and, unless the master is
    what the device copies (fp32 without a delayed update), a stage in the compute dtype; its gradient comes home in
    the compute dtype, two steps' worth with a delayed update (which a flat 16 bytes a parameter under-counted)."""
    def host(mode: str, delayed: bool) -> tuple[int, int]:
        cfg = mixtral_on_one_gpu("train", precision=precision)
        cfg.storage = StorageConfig(offload=mode, delayed_update=delayed)
        r = plan_placement(cfg).per_rank
        return r.host, r.local_experts * plan_placement(cfg).params.per_expert

    exact, local = host("cpu", False)
    assert exact == (slot + grad) * local == 16 * local
    delayed, _ = host("cpu", True)
    assert delayed == (12 + (4 if precision == "fp32" else 2) + 2 * grad) * local  # fp32: 24, bf16: 18
    assert planner.host_slot_bytes(mixtral_on_one_gpu("train", precision=precision)) == slot


def test_the_hint_to_keep_layers_names_the_fit_only_while_more_would_fit():
    """`moesys plan` and `moesys train` print it for offloaded training on GPUs with room to keep more layers."""
    cfg = mixtral_on_one_gpu("train", seq_len=512)
    cfg.topology.gpu_memory_gb = 141  # room for a layer or two of Mixtral's 22.5 GB of expert states per layer
    cfg.storage = StorageConfig(offload="cpu")
    plan = plan_placement(cfg)
    fit = plan.keepable_layers
    assert 0 < fit < MIXTRAL.num_layers - 1
    assert planner.keep_layers_hint(plan) == (
        f"the GPU has room to keep {fit} of the {MIXTRAL.num_layers} MoE layers' experts: "
        f"storage.resident_layers={fit} takes their update off the CPU optimizer")
    cfg.storage = StorageConfig(offload="cpu", resident_layers=fit)
    assert planner.keep_layers_hint(plan_placement(cfg)) is None
    cfg.storage = StorageConfig(offload="none")
    assert planner.keep_layers_hint(plan_placement(cfg)) is None
