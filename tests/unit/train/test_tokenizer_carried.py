"""A run's tokenizer travels with its model: every checkpoint carries tokenizer.json, inference reads it from there,
`moesys export` writes it into both formats, and a distillation student trains with the teacher's copy. A checkpoint
written before tokenizers were saved is read and exported with the byte tokenizer its config names."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.config import ModelConfig, MoesysConfig, TrainConfig
from runtime.inference.export import export_checkpoint
from runtime.inference.load import load_model
from runtime.parallel.groups import build_groups
from runtime.train.run_setup import prepare_run_dir
from runtime.train.checkpoint import latest_checkpoint
from runtime.train.loop import train
from runtime.train.student_config import find_teacher, student_recipe
from runtime.data.text import CORPUS_DIR
from runtime.data.tokenizer import ByteTokenizer, byte_tokenizer_json, load_tokenizer
from runtime.data.tokenizer_train import train_bpe
from tests.trained_run import train_run_dir

PROMPT = "The wind over the hills, naïve café"


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory) -> tuple[Path, Path]:
    """(a run trained one step with a 300-token BPE, the tokenizer file it was given)."""
    root = tmp_path_factory.mktemp("bpe")
    train_bpe(CORPUS_DIR, 300, root / "bpe.json")
    model = ModelConfig(hidden_size=32, num_layers=2, num_heads=2, vocab_size=300, ffn_hidden_size=64, num_experts=4,
                        max_seq_len=48)
    cfg = MoesysConfig(model=model, train=TrainConfig(max_steps=1, micro_batch_size=2, seq_len=16, warmup_steps=1,
                                                      run_dir=str(root / "run"), tokenizer=str(root / "bpe.json")))
    cfg.topology.nproc_per_node = 1
    path = prepare_run_dir(cfg)
    train(cfg, path, build_groups(1, 0, 1, 1), torch.device("cpu"))
    return path, root / "bpe.json"


def test_checkpoints_inference_and_both_export_formats_carry_the_runs_tokenizer(bpe_run, tmp_path):
    run_dir, given = bpe_run
    want = load_tokenizer(given)
    step = latest_checkpoint(run_dir)
    assert (step / "tokenizer.json").read_text() == want.to_str()
    given_ids = want.encode(PROMPT)
    assert load_model(run_dir).tokenizer.encode(PROMPT) == given_ids
    summary = export_checkpoint(run_dir, tmp_path / "export")
    assert summary["tokenizer"] == "tokenizer.json"
    assert load_tokenizer(tmp_path / "export" / "tokenizer.json").encode(PROMPT) == given_ids
    assert load_model(tmp_path / "export").tokenizer.encode(PROMPT) == given_ids


def test_a_student_trains_with_the_teachers_copy_of_its_tokenizer(bpe_run):
    run_dir, _ = bpe_run
    recipe = student_recipe(find_teacher(run_dir), 2)
    assert recipe["train"]["tokenizer"] == str(latest_checkpoint(run_dir) / "tokenizer.json")


def test_a_checkpoint_without_a_tokenizer_file_is_read_and_exported_with_the_bytes_its_config_names(tmp_path):
    run_dir = train_run_dir(tmp_path / "run")
    for old in run_dir.rglob("tokenizer.json"):  # as written before checkpoints carried one
        old.unlink()
    assert isinstance(load_model(run_dir).tokenizer, ByteTokenizer)
    export_checkpoint(run_dir, tmp_path / "export")
    assert (tmp_path / "export" / "tokenizer.json").read_text() == byte_tokenizer_json(specials=False)  # 256 rows
    assert student_recipe(find_teacher(run_dir), 2)["train"]["tokenizer"] == "bytes"
