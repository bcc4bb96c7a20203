"""Reading a moesys checkpoint for inference and export: a missing or foreign directory is named, only the files
holding model weights are checksummed, the moments beside the weights are evicted from the page cache afterwards,
and an exported model's directory gets the mode mkdir would give it."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch

from runtime.config import ModelConfig, MoesysConfig, config_to_dict
from runtime.errors import UserError
from runtime.inference import load
from runtime.inference.export import export_checkpoint
from runtime.inference.load import load_model, read_moesys
from runtime.model.transformer import Transformer
from runtime.moe.layer import is_expert_param
from runtime.parallel.groups import build_groups
from runtime.files.run_dir import load_config
from runtime.files.tensorfile import save_tensors
from runtime.train.checkpoint import latest_checkpoint, load_checkpoint
from tests.trained_run import train_run_dir

CFG = MoesysConfig(model=ModelConfig(hidden_size=16, num_layers=2, num_heads=2, ffn_hidden_size=32, num_experts=4,
                                     vocab_size=256, max_seq_len=128))


def write_step(step) -> dict[str, torch.Tensor]:
    """A step directory as training writes it: weights beside their moments, RNG and a task head apart."""
    step.mkdir(parents=True)
    torch.manual_seed(0)
    model = Transformer(CFG.model)
    dense, experts = {}, {}
    for name, p in model.named_parameters():
        if is_expert_param(name):
            for g in range(p.shape[0]):
                experts[f"model.{name}.{g}"] = p[g].detach().clone()
                experts[f"exp_avg.{name}.{g}"] = torch.zeros_like(p[g])
        else:
            dense[f"model.{name}"] = p.detach().clone()
            dense[f"exp_avg.{name}"] = torch.zeros_like(p)
    save_tensors(step / "dense.safetensors", dense)
    save_tensors(step / "experts-ep0.safetensors", experts)
    save_tensors(step / "rng-rank0.safetensors", {"cpu": torch.zeros(4, dtype=torch.uint8)})
    save_tensors(step / "heads-x.safetensors", {"model.task_heads.x.weight": torch.ones(3)})
    (step / "meta.json").write_text(json.dumps({"step": 1, "config": config_to_dict(CFG)}))
    return {k[len("model."):]: v for k, v in {**dense, **experts}.items() if k.startswith("model.")}


def damage(path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))


def test_only_files_with_model_weights_are_verified_and_then_evicted(tmp_path, monkeypatch):
    step = tmp_path / "step"
    write_step(step)
    damage(step / "heads-x.safetensors")  # inference never reads it: its checksum is not its business
    evicted = {}
    monkeypatch.setattr(load, "evict", lambda path, ranges: evicted.setdefault(path.name, sorted(ranges)))
    checkpoint = read_moesys(step)
    assert [f.path.name for f in checkpoint.files.files] == ["dense.safetensors", "experts-ep0.safetensors"]
    assert list(evicted) == ["dense.safetensors", "experts-ep0.safetensors"]
    for name, ranges in evicted.items():  # exactly the moments' bytes: the weights stay cached for the load
        header, start = load.read_header(step / name)
        moments = sorted((start + e["data_offsets"][0], e["data_offsets"][1] - e["data_offsets"][0])
                         for k, e in header.items() if k.startswith("exp_avg."))
        assert ranges == moments and moments
    damage(step / "experts-ep0.safetensors")
    with pytest.raises(UserError, match="experts-ep0.safetensors is damaged") as exc:
        read_moesys(step)
    assert "\n" not in str(exc.value)


def test_loaded_expert_parameters_keep_requires_grad_like_the_dense_ones(tmp_path):
    step = tmp_path / "step"
    weights = write_step(step)
    model = load_model(step).model
    params = dict(model.named_parameters())
    assert all(p.requires_grad for p in params.values())
    w1 = params["layers.0.ffn.experts.w1"]
    assert torch.equal(w1[2], weights["layers.0.ffn.experts.w1.2"])


@pytest.mark.parametrize("where,message", [
    ("missing", "missing: no such directory"),
    ("hf", "model_type=None is not one of mixtral, qwen2_moe, qwen3_moe, olmoe, ernie4_5_moe"),
])
def test_a_missing_or_foreign_checkpoint_is_named(tmp_path, where, message):
    path = tmp_path / where
    if where == "hf":  # a Hugging Face directory of no family moesys reads
        path.mkdir()
        (path / "config.json").write_text("{}")
    with pytest.raises(UserError, match=message):
        export_checkpoint(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_exported_directory_has_the_mode_mkdir_gives(tmp_path):
    step = tmp_path / "step"
    write_step(step)
    old = os.umask(0o027)
    try:
        summary = export_checkpoint(step, tmp_path / "out")
    finally:
        os.umask(old)
    out = tmp_path / "out"
    assert stat.S_IMODE(out.stat().st_mode) == 0o750
    assert stat.S_IMODE((out / "model.safetensors").stat().st_mode) == 0o640
    assert summary["checkpoint_bytes"] == sum(f.stat().st_size for f in step.glob("*.safetensors"))
    assert torch.equal(load_model(out).model.tok_embeddings.weight, load_model(step).model.tok_embeddings.weight)


def test_a_deleted_file_of_a_training_checkpoint_or_an_export_is_named(tmp_path):
    run = train_run_dir(tmp_path / "run")
    step = latest_checkpoint(run)
    assert json.loads((step / "meta.json").read_text())["files"] == ["dense.safetensors", "experts-ep0.safetensors"]
    assert export_checkpoint(run, tmp_path / "export")["optimizer_state"]
    assert not export_checkpoint(tmp_path / "export", tmp_path / "again")["optimizer_state"]  # an export's export
    (step / "experts-ep0.safetensors").unlink()
    (tmp_path / "export" / "model.safetensors").unlink()
    cfg = load_config(run)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    for read, where in ((lambda: load_model(run), step), (lambda: export_checkpoint(run, tmp_path / "x"), step),
                        (lambda: load_checkpoint(step, model, None, build_groups(1, 0, 1, 1)), step),
                        (lambda: load_model(tmp_path / "export"), tmp_path / "export")):
        with pytest.raises(UserError, match=f"{where} is missing (experts-ep0|model).safetensors .its meta.json lists"):
            read()
    meta = json.loads((step / "meta.json").read_text())
    del meta["files"]  # as a checkpoint written before meta.json listed its files
    (step / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match=f"{step} is missing experts-ep0.safetensors, which holds expert 0 "):
        load_model(run)


def test_an_export_its_disk_cannot_hold_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """The free space of out='s filesystem is what the machine reports; here it reports 1 KB."""
    import shutil
    from collections import namedtuple

    from runtime.plan import disk

    step = tmp_path / "step"
    write_step(step)
    usage, real = namedtuple("usage", "total used free"), shutil.disk_usage
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(UserError) as refused:
        export_checkpoint(step, tmp_path / "deep" / "out")
    message = str(refused.value)
    assert message.startswith("not enough disk: ") and "\n" not in message
    assert f"to write to {tmp_path / 'deep' / 'out'} (" in message and "has 1.00 KB free" in message
    assert "export.dtype=bf16" in message
    assert not (tmp_path / "deep").exists()
    monkeypatch.setattr(disk.shutil, "disk_usage", real)
    assert export_checkpoint(step, tmp_path / "deep" / "out")["bytes"] > 1000
