"""runtime/plan/disk.py: the bytes a run writes (expert store, checkpoints on disk at once) and the free-space
check that refuses a run or an export whose filesystem cannot hold them."""

from __future__ import annotations

import pytest

from runtime.config import ModelConfig, MoesysConfig, StorageConfig, TopologyConfig, TrainConfig
from runtime.errors import UserError
from runtime.plan.params import count_parameters
from runtime.plan.budget import GB
from runtime.plan.disk import KEEP_CHECKPOINTS, check_free, checkpoints_on_disk, checkpoints_written
from runtime.plan.planner import plan_placement, plan_to_dict


def train(**keys) -> MoesysConfig:
    return MoesysConfig(train=TrainConfig(**keys))


@pytest.mark.parametrize("keys,written", [
    (dict(max_steps=100, checkpoint_every=50), 2),  # 50, and 100 is both a checkpoint_every step and the last
    (dict(max_steps=120, checkpoint_every=50), 3),  # 50, 100 and the final one
    (dict(max_steps=120, checkpoint_every=0), 1),
    (dict(max_steps=120, checkpoint_every=0, final_checkpoint=False), 0),
    (dict(max_steps=300, checkpoint_every=10), 30),
])
def test_the_checkpoints_a_run_writes(keys, written):
    assert checkpoints_written(train(**keys)) == written


def test_the_kept_checkpoints_and_the_one_being_written_are_on_disk_at_once():
    cfg = train(max_steps=300, checkpoint_every=10)
    assert KEEP_CHECKPOINTS == 2 and checkpoints_on_disk(cfg) == 3
    assert checkpoints_on_disk(train(max_steps=100, checkpoint_every=50)) == 2
    resumed = train(max_steps=150, checkpoint_every=50)  # steps 50 and 100 on disk; 150 still to come
    assert checkpoints_on_disk(resumed, existing=2, first_step=100) == 3


def test_the_plan_counts_the_store_of_each_rank_and_every_checkpoint_on_disk():
    model = ModelConfig(num_experts=8, num_layers=4)
    topo = TopologyConfig(nproc_per_node=2, expert_parallel=2, ssd_gb=100)
    p = count_parameters(model)
    ssd = plan_placement(MoesysConfig(model=model, topology=topo, storage=StorageConfig(offload="ssd")))
    # two ranks a node, half the experts each, one file an expert in whole I/O blocks after a header block
    per_file = 4096 + -(-(12 * p.per_expert + 4) // 4096) * 4096
    assert ssd.disk.store_bytes == 2 * (p.sparse // p.per_expert // 2) * per_file
    tensors = 29 * 4 + 5 + 2 * 2 * 8 * 4  # at most 29 a block and 5 more; 8 experts x (w1, w2, b1, b2) x 4 layers
    assert ssd.disk.checkpoint_bytes == 12 * p.total + tensors * (4 * 192 + 4) + 2**20
    assert ssd.disk.checkpoints == 2  # steps 50 and 100 of 100
    # storage.offload=cpu keeps the experts' states in host RAM: no store
    assert plan_placement(MoesysConfig(model=model, topology=topo, storage=StorageConfig(offload="cpu"))).disk \
        .store_bytes == 0
    assert plan_to_dict(ssd)["disk"]["total_bytes"] == ssd.disk.store_bytes + 2 * ssd.disk.checkpoint_bytes


def test_the_store_and_a_checkpoint_on_disk_are_what_the_plan_counts(tmp_path):
    """A real run's files: the store exactly the plan's, a checkpoint above its 12 bytes a parameter and within the
    plan's count."""
    import torch

    import runtime.train.loop as loop
    from runtime.parallel.groups import build_groups

    cfg = MoesysConfig(model=ModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_experts=4, max_seq_len=32),
                       storage=StorageConfig(offload="ssd", ssd_path=str(tmp_path / "store")),
                       train=TrainConfig(seq_len=16, micro_batch_size=2, max_steps=1, run_dir=str(tmp_path / "run")))
    plan = plan_placement(cfg)
    (tmp_path / "run").mkdir()
    loop.train(cfg, tmp_path / "run", build_groups(1, 0, 1, 1), torch.device("cpu"))
    store = sum(f.stat().st_size for f in (tmp_path / "store").rglob("*.safetensors"))
    checkpoint = sum(f.stat().st_size for f in (tmp_path / "run" / "checkpoints").rglob("*") if f.is_file())
    assert store == plan.per_rank.ssd  # one process here: the node's store is this rank's
    assert 12 * count_parameters(cfg.model).total < checkpoint <= plan.disk.checkpoint_bytes


def test_a_disk_too_small_for_the_checkpoints_does_not_fit_and_fewer_checkpoints_do():
    cfg = MoesysConfig(model=ModelConfig(ffn_hidden_size=256), topology=TopologyConfig(ssd_gb=0.05),
                       train=TrainConfig(max_steps=300, checkpoint_every=100))  # the tiny recipe: 29 MB a checkpoint
    plan = plan_placement(cfg)
    assert not plan.feasible
    assert plan.problems == ["disk per node 0.09 GB (3 checkpoints of 0.03 GB) > topology.ssd_gb=0.05 GB"]
    assert plan.suggestions[-1] == "train.checkpoint_every=0 fits (only the final checkpoint is written)"
    cfg.train.checkpoint_every = 0
    assert plan_placement(cfg).feasible


def test_bytes_beyond_the_free_space_are_refused_in_one_line_naming_the_path(tmp_path):
    target = tmp_path / "run" / "checkpoints"
    check_free([(target, 1000, "a little")], "fix it")  # fits
    with pytest.raises(UserError) as refused:
        check_free([(target, 10**18 // 2, "half"), (tmp_path / "store", 10**18 // 2, "the other half")], "fix it")
    message = str(refused.value)
    assert message.startswith(f"not enough disk: {10**18 / GB:.2f} GB to write to {target} and {tmp_path / 'store'} "
                              "(half + the other half) but its filesystem has ") and message.endswith("; fix it")
    assert "\n" not in message and not target.exists()
