"""train.init_from: the model section comes from the source's config (a Hugging Face directory's config.json alone, or
a moesys run's), explicit model.* overrides that contradict the weights are refused and the others apply, the
tokenizer and its generation facts travel with it; each rank's part (its block of experts, resident or in its cpu or ssd home) is filled from
the files with exactly the source's weights."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from moesys_cli.resolve import resolve_config
from runtime.config import ConfigError, MoesysConfig, StorageConfig, TrainConfig, validate
from runtime.errors import UserError
from runtime.hf.checkpoint import load_hf_model
from runtime.moe.layer import is_expert_param
from runtime.parallel.groups import build_groups
from runtime.train.build import build_components
from runtime.data.generation_facts import GenerationFacts, hf_facts, recorded_facts
from runtime.data.tokenizer import run_tokenizer
from runtime.train.init_from import InitialWeights, apply_init_from, record_source_facts
from tests.hf_families import save_sharded, tiny_model

pytest.importorskip("transformers", reason="transformers is not installed")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return save_sharded(tiny_model("qwen3_moe"), tmp_path_factory.mktemp("init") / "qwen3")


def test_the_model_section_and_tokenizer_come_from_the_source(source):
    cfg = resolve_config(["recipe=tiny", f"train.init_from={source}", "train.seq_len=32"])
    want, _ = load_hf_model(source)
    assert cfg.model == want
    assert cfg.model.family == "qwen3_moe" and cfg.train.tokenizer == str(source / "tokenizer.json")
    assert cfg.train.lr == resolve_config(["recipe=tiny"]).train.lr  # the recipe's other sections stay


def test_an_explicit_override_the_weights_fix_is_refused_naming_both_values(source):
    with pytest.raises(ConfigError, match=r"model.num_experts=16 contradicts train.init_from=.*whose weights have "
                                          r"num_experts=8; drop the override"):
        resolve_config(["recipe=tiny", f"train.init_from={source}", "model.num_experts=16", "train.seq_len=32"])
    agreeing = resolve_config(["recipe=tiny", f"train.init_from={source}", "model.num_experts=8", "train.seq_len=32"])
    assert agreeing.model.num_experts == 8
    with pytest.raises(ConfigError, match="model=GROUP and train.init_from both choose the model"):
        resolve_config([f"train.init_from={source}", "model=mixtral-8x7b"])


def test_an_override_of_how_the_router_trains_applies(source):
    cfg = resolve_config(["recipe=tiny", f"train.init_from={source}", "model.aux_loss_weight=0.001",
                          "model.max_seq_len=64", "train.seq_len=32"])
    assert (cfg.model.aux_loss_weight, cfg.model.max_seq_len, cfg.model.num_experts) == (0.001, 64, 8)


def test_a_source_without_tokenizer_trains_with_train_tokenizer_which_must_fit(tmp_path):
    bare = save_sharded(tiny_model("olmoe"), tmp_path / "bare", tokenizer=False)
    cfg = resolve_config(["recipe=tiny", f"train.init_from={bare}", "train.seq_len=32"])
    assert cfg.train.tokenizer == "bytes" and cfg.model.vocab_size == 256
    small = save_sharded(tiny_model("olmoe", vocab_size=200), tmp_path / "small", tokenizer=False)
    with pytest.raises(ConfigError, match=r"init_from=.*small has no tokenizer.json and a vocabulary of 200 tokens, "
                                          r"fewer than the byte tokenizer's 256"):
        resolve_config(["recipe=tiny", f"train.init_from={small}", "train.seq_len=32"])


@pytest.mark.parametrize("path,says", [
    ("missing", "train.init_from=.*missing: no such directory"),
    ("empty", "neither a Hugging Face model directory"),
])
def test_a_source_that_is_not_a_model_is_one_line(tmp_path, path, says):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=says):
        resolve_config(["recipe=tiny", f"train.init_from={tmp_path / path}"])


def test_recipe_finetune_needs_init_from_and_sets_a_fine_tune_schedule(source):
    with pytest.raises(ConfigError, match="^recipe=finetune fine-tunes a model: set train.init_from=DIR"):
        resolve_config(["recipe=finetune"])
    tr = resolve_config(["recipe=finetune", f"train.init_from={source}", "train.seq_len=64"]).train
    assert (tr.lr_schedule, tr.min_lr, tr.weight_decay) == ("linear", 0.0, 0.0) and tr.lr <= 1e-4
    assert tr.checkpoint_every > 0 and 0 < tr.warmup_steps < tr.max_steps


def test_a_fresh_start_records_the_sources_generation_facts_for_its_tokenizer(source, tmp_path):
    """The source's template, tokens and stop ids when the run trains with the source's tokenizer; the template alone
    with another tokenizer (the ids would be another vocabulary's); nothing without train.init_from."""
    run = tmp_path / "run"
    run.mkdir()
    args = ["recipe=tiny", "train.seq_len=32", f"train.run_dir={run}"]
    cfg = resolve_config([*args, f"train.init_from={source}"])
    kept = record_source_facts(cfg)
    assert kept == hf_facts(source) == recorded_facts(run) and kept.chat_template is not None
    assert run_tokenizer(cfg).facts == kept and run_tokenizer(cfg).chat_template == kept.chat_template
    other = resolve_config([*args, f"train.init_from={source}", "train.tokenizer=bytes"])
    assert record_source_facts(other) == GenerationFacts(kept.chat_template) == recorded_facts(run)
    assert record_source_facts(resolve_config(args)) is None and recorded_facts(run) is None


def ep_groups(ep: int, rank: int):
    """What build_groups gives expert-parallel rank `rank` of `ep`, without process groups (nothing here talks)."""
    return dataclasses.replace(build_groups(1, 0, 1, 1), ep_size=ep, ep_rank=rank)


@pytest.mark.parametrize("offload", ["none", "cpu", "ssd"])
def test_each_rank_gets_its_block_of_experts_and_the_dense_weights_from_the_files(source, tmp_path, offload):
    cfg = MoesysConfig(storage=StorageConfig(offload=offload, ssd_path=str(tmp_path / "store")),
                       train=TrainConfig(init_from=str(source), seq_len=16, micro_batch_size=2,
                                         run_dir=str(tmp_path / "run")))
    apply_init_from(cfg, set())
    validate(cfg)
    _, full = load_hf_model(source)
    want = dict(full.named_parameters())
    for rank in (0, 1):
        initial = InitialWeights(source)
        c = build_components(cfg, ep_groups(2, rank), CPU, initial=initial)
        initial.close()
        got = dict(c.model.named_parameters())
        for name, param in want.items():
            if not is_expert_param(name):
                assert torch.equal(got[name], param), name
            elif offload == "none":
                assert torch.equal(got[name], param[4 * rank:4 * rank + 4]), name
        if c.offload is not None:
            for spec in c.offload.specs.values():
                assert spec.first_global == 4 * rank and spec.num_local == 4
                for j in range(4):
                    slot = c.offload.home.checkpoint_slot(spec.key(j))
                    for w, view in slot.views("master", spec.layout).items():
                        assert torch.equal(view, want[f"{spec.param_prefix}.{w}"][4 * rank + j])
                    assert not slot.exp_avg.any() and float(slot.step) == 0  # weights only: a fresh optimizer
            c.offload.close()


def test_a_moesys_run_is_a_source_too(source, tmp_path):
    """export.format=moesys of the released model, then init_from that export: the same weights."""
    from runtime.inference.export import export_checkpoint

    export_checkpoint(source, tmp_path / "export", "moesys")
    cfg = resolve_config(["recipe=tiny", f"train.init_from={tmp_path / 'export'}", "train.seq_len=32"])
    assert cfg.model.family == "qwen3_moe" and cfg.train.tokenizer.endswith("tokenizer.json")
    initial = InitialWeights(tmp_path / "export")
    c = build_components(cfg, build_groups(1, 0, 1, 1), CPU, initial=initial)
    initial.close()
    _, full = load_hf_model(source)
    for name, param in full.named_parameters():
        assert torch.equal(dict(c.model.named_parameters())[name], param), name
