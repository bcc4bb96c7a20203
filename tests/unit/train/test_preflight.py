"""runtime/train/preflight.py, on resolved configs as `moesys train` runs it before launching: the expert store and
the checkpoints must fit the free space of the filesystems they go to; the tokenizer, every data source and the
resume point must be usable, or one line names the key."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from moesys_cli.resolve import resolve_config
from runtime.errors import UserError
from runtime.plan.checks import check_disk
from runtime.train.preflight import check_before_launch
from runtime.data.text import CORPUS_DIR
from runtime.data.tokenizer_train import train_bpe

HUGE = ["recipe=tiny", "model.num_experts=512", "model.hidden_size=8192", "model.ffn_hidden_size=32768",
        "model.num_layers=12", "model.num_heads=64", "train.lr=1e-4"]  # 4.95T parameters: 59 TB a checkpoint
NO_CHECKPOINTS = ["train.checkpoint_every=0", "train.final_checkpoint=false"]


@pytest.mark.parametrize("extra,target,written", [
    ([], "checkpoints", "(3 checkpoints of 59412.97 GB at once, 2 kept and the next being written)"),
    (["storage.offload=ssd", *NO_CHECKPOINTS], "expert_store", "(expert store "),
])
def test_files_the_disk_cannot_hold_are_refused_in_one_line(tmp_path, extra, target, written):
    run_dir = tmp_path / "run"
    with pytest.raises(UserError) as refused:
        check_disk(resolve_config([*HUGE, *extra, f"train.run_dir={run_dir}"]))
    line = str(refused.value)
    assert line.startswith("not enough disk: ") and f"GB to write to {run_dir / target} {written}" in line, line
    assert "but its filesystem has " in line and "set train.run_dir or storage.ssd_path to a larger disk" in line
    assert "\n" not in line and not run_dir.exists()


def test_what_fits_passes_and_a_slurm_jobs_stores_are_not_this_machines(tmp_path):
    check_disk(resolve_config(["recipe=tiny", f"train.run_dir={tmp_path / 'run'}"]))
    check_disk(resolve_config([*HUGE, "storage.offload=ssd", *NO_CHECKPOINTS, "launcher=slurm",
                               f"train.run_dir={tmp_path / 'run'}"]))


# ---- the tokenizer, every data source and the resume point, before anything is written ----


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    train_bpe(CORPUS_DIR, 300, root / "bpe.json")
    (root / "docs.jsonl").write_text(json.dumps({"body": "a document long enough " * 20}) + "\n")
    np.save(root / "floats.npy", np.zeros(1000, dtype=np.float32))
    np.arange(1000, dtype=np.uint16).tofile(root / "wide.bin")  # ids up to 999: another vocabulary's
    (root / "short.txt").write_text("too short")
    return root


@pytest.mark.parametrize("overrides,message", [
    (["train.tokenizer={root}/missing.json"], "train.tokenizer={root}/missing.json does not exist; give bytes or "
                                              "the path of a Hugging Face tokenizer.json"),
    (["train.tokenizer={root}/bpe.json", "model.vocab_size=256"],
     "train.tokenizer={root}/bpe.json has 300 tokens, more than model.vocab_size=256; set model.vocab_size=300 "
     "(or more)"),
    (["train.data={root}/docs.jsonl"], "train.data={root}/docs.jsonl line 1 has no 'text' string (its keys: body); "
                                       "set train.data_text_key"),
    (["train.data={root}/floats.npy"], "train.data={root}/floats.npy holds a float32 array"),
    (["train.data={root}/wide.bin"], "train.data={root}/wide.bin holds token id 999, not below the vocabulary's 320"),
    (["train.eval_data={root}/short.txt"], "train.eval_data={root}/short.txt holds 9 tokens, fewer than "
                                           "train.seq_len + 1"),
    (["train.eval_data={root}/nothing"], "train.eval_data={root}/nothing does not exist"),
])
def test_a_tokenizer_or_data_that_cannot_be_used_is_one_line_naming_its_key(files, tmp_path, overrides, message):
    cfg = resolve_config(["recipe=tiny", f"train.run_dir={tmp_path / 'run'}",
                          *(o.format(root=files) for o in overrides)])
    with pytest.raises(UserError, match=re.escape(message.format(root=files))) as refused:
        check_before_launch(cfg)
    assert "\n" not in str(refused.value) and not (tmp_path / "run").exists()


def test_usable_inputs_of_each_kind_pass(files, tmp_path):
    check_before_launch(resolve_config([
        "recipe=tiny", f"train.run_dir={tmp_path / 'run'}", f"train.tokenizer={files}/bpe.json", "model.vocab_size=300",
        f"train.data={files}/docs.jsonl", "train.data_text_key=body", f"train.eval_data={files}/wide.bin",
        "model.vocab_size=1000", "train.seq_len=64"]))


def test_a_resume_keeps_the_tokenizer_its_checkpoint_was_trained_with(files, tmp_path):
    from tests.trained_run import train_run_dir

    run_dir = train_run_dir(tmp_path / "run")  # bytes; its checkpoint carries the byte tokenizer.json
    assert (latest := sorted((run_dir / "checkpoints").glob("step_*"))[-1] / "tokenizer.json").is_file(), latest
    other = ["recipe=tiny", f"train.run_dir={run_dir}", f"train.tokenizer={files}/bpe.json", "model.vocab_size=300"]
    with pytest.raises(UserError, match=re.escape(f"cannot resume {run_dir} from step_00000001: it was trained with "
                                                  f"another tokenizer ({latest}); set train.tokenizer={latest}, "
                                                  "train.resume_from=none to start over")):
        check_before_launch(resolve_config(other))
    check_before_launch(resolve_config([*other, "train.resume_from=none"]))
    with pytest.raises(UserError, match=r"train.resume_from=step_9: .* \(it has: step_1\)"):
        check_before_launch(resolve_config(["recipe=tiny", f"train.run_dir={run_dir}", "train.resume_from=step_9"]))
