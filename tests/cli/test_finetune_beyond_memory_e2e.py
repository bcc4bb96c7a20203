"""A released model twice the memory it trains in: a sharded random checkpoint of 4.4 GB in the Qwen3-MoE layout
(fp32, 128 experts a layer, transformers 5's fused expert tensors, written here tensor by tensor so that the test never
holds it) is loaded with train.init_from and trains 3 steps with storage=ssd on 2 processes (expert parallel 2) inside
a memory cap of half its size; each rank streams its experts from the files into its store. The store and the
checkpoint fit the disk the plan counts, and the plan's peaks are set beside the measured ones."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import torch

from runtime.host import memcap
from runtime.files.tensorfile import write_tensors
from tests.cli.conftest import moesys_bin

pytestmark = [pytest.mark.skipif(memcap.available() is not None, reason=f"no memory cap: {memcap.available()}"),
              pytest.mark.extended]
transformers = pytest.importorskip("transformers", reason="transformers is not installed")
CONFIG = dict(hidden_size=1024, num_hidden_layers=11, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
              moe_intermediate_size=256, intermediate_size=512, num_experts=128, num_experts_per_tok=1,
              norm_topk_prob=True, vocab_size=256, max_position_embeddings=64, tie_word_embeddings=False)
SHARD_BYTES = 1 << 30


def write_checkpoint(path) -> int:
    """config.json by transformers' Qwen3MoeConfig, and every parameter of its meta-device model as random fp32 in
    shards of about 1 GB with an index; one tensor in memory at a time. Returns the bytes written."""
    config = transformers.Qwen3MoeConfig(**CONFIG)
    config.save_pretrained(path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    params = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    shards, size = [[]], 0
    for name, shape in params:
        nbytes = 4 * torch.Size(shape).numel()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    gen = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0

    def tensors(shard):
        for name, shape in shard:
            scale = 1.0 if name.endswith("norm.weight") else 0.02
            yield name, (torch.ones(shape) if scale == 1.0 else torch.randn(shape, generator=gen) * scale)

    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_tensors(path / file, {n: (torch.float32, s) for n, s in shard}, tensors(shard), {"format": "pt"})
        weight_map.update({n: file for n, _ in shard})
        total += (path / file).stat().st_size
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}))
    return total


def du(path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_a_checkpoint_twice_the_memory_cap_fine_tunes_with_storage_ssd(tmp_path):
    source = tmp_path / "qwen3-4g"
    size = write_checkpoint(source)
    assert size >= 4e9
    run_dir = tmp_path / "run"
    cap_bytes = size // 2
    args = ["train", "recipe=tiny", f"train.init_from={source}", "topology=local", "topology.nproc_per_node=2",
            "topology.expert_parallel=2", "storage.offload=ssd", "storage.alpha=0.015625", "train.seq_len=1",
            "train.micro_batch_size=1", "train.max_steps=3", "train.warmup_steps=1", "train.checkpoint_every=0",
            f"train.run_dir={run_dir}"]
    env = dict(os.environ, COLUMNS="200")
    with memcap.MemoryCap(cap_bytes, "moesys-finetune") as cap:
        done = subprocess.run([moesys_bin(), *args], capture_output=True, text=True, timeout=3000, env=env,
                              preexec_fn=cap.preexec)
        oom_kills, peak = cap.oom_kills(), cap.max_usage()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert oom_kills == 0 and "Traceback" not in done.stderr
    plan = json.loads((run_dir / "plan.json").read_text())
    store, checkpoints = du(run_dir / "expert_store"), du(run_dir / "checkpoints")
    disk = plan["plan"]["disk"]
    print(f"checkpoint {size / 1e9:.2f} GB, cap {cap_bytes / 1e9:.2f} GB, measured peak of the cgroup "
          f"{peak / 1e9:.2f} GB; store {store / 1e9:.2f} GB (plan {disk['expert_store_bytes'] / 1e9:.2f}), "
          f"checkpoints {checkpoints / 1e9:.2f} GB (plan {disk['total_bytes'] / 1e9:.2f} in all)")
    assert store + checkpoints <= disk["total_bytes"]
    assert (run_dir / "checkpoints" / "step_00000003" / "meta.json").is_file()
    compared = subprocess.run([moesys_bin(), "plan", "--compare", str(run_dir), "--json"], capture_output=True,
                              text=True, timeout=300, env=env)
    assert compared.returncode == 0, compared.stderr
    ranks = json.loads(compared.stdout)["ranks"]
    for rank in ranks:  # the plan's peak of each tier beside the measured one
        for tier, row in rank["tiers"].items():
            print(f"rank {rank['rank']} {tier}: plan {row['predicted_bytes'] / 1e9:.2f} GB, measured "
                  f"{(row['measured_bytes'] or 0) / 1e9:.2f} GB")
    assert len(ranks) == 2 and all(rank["tiers"]["ram"]["measured_bytes"] for rank in ranks)
    for bulky in (run_dir, source):  # 31 GB on disk: not left for pytest's kept temporary directories
        shutil.rmtree(bulky)
